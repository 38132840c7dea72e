"""What a request to `zerotune serve` goes through before llama-cpp-python sees it.

llama-cpp-python's server answers a wrong-typed field with HTTP 500 and its validation dump (server file paths included),
a streaming request that fails with 200 and an empty stream, and some requests by crashing the whole process: a
`grammar` without a `root` rule, an out-of-range token id in /extras/detokenize, a JSON schema with `maxLength: 30000`
(llama.cpp gets a NULL sampler, reads past its vocabulary, overflows its stack). `Guard` sits in front of it:

1. routes: only POST /v1/chat/completions, POST /v1/completions and GET /v1/models (+ CORS preflight); anything
   else is 404/405 (the /extras endpoints and embeddings are not served);
2. the API key, when one is set (401);
3. the body: at most serve.max_request_kb (413), counted here as it is read; what it must be (UTF-8 JSON, 400)
   is serve_request.py's,
4. and so are the fields (400, naming the field): llama-cpp-python's own request models in strict mode, then
   zerotune's rules for what those types let through;
5. the model (serve_model_checks.py): the chat template renders the conversation, the prompt fits the context,
   every grammar the request implies parses in llama.cpp;
6. admission: one request is generated at a time (llama-cpp-python's lock); at most serve.max_queue wait behind
   it, more get 429 with Retry-After (the recent time per request, so the next slot should be free by then).

Every error is one OpenAI-shaped body, `{"error": {"message", "type", "param", "code"}}`, naming the field. A response
llama-cpp-python fails to produce is held back until its first byte, so a streaming request that fails before its
first token gets a status code, not an empty 200; a 5xx never carries the exception text (it goes to the log).
"""

from __future__ import annotations

import hmac
import json
import math
import sys
import time
import traceback

from .serve_model_checks import ModelFacts
from .serve_request import (CHAT, COMPLETIONS, MODELS, ApiError, Limits, bad, check_chat, check_completion,
                            encode_body, parse_body)

ROUTES = {CHAT: "POST", COMPLETIONS: "POST", MODELS: "GET"}


async def _send_error(send, e: ApiError) -> None:
    body = e.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _shaped(status: int, raw: bytes, where: str) -> ApiError:
    """An error response from llama-cpp-python or FastAPI in OpenAI's shape; a 5xx never shows its text."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if status >= 500:
        print(f"serve: {status} on {where}: {raw[:2000].decode('utf-8', 'replace')}", file=sys.stderr, flush=True)
        return ApiError(status, "The server had an error while processing your request.", type="server_error")
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        return ApiError(status, str(err.get("message")), err.get("param"), err.get("code"),
                        err.get("type") or "invalid_request_error")
    detail = data.get("detail") if isinstance(data, dict) else None
    return ApiError(status, detail if isinstance(detail, str) else "The request was refused.")


class Guard:
    """ASGI middleware: steps 1-6 of the module docstring, then the app, its errors reshaped."""

    def __init__(self, app, limits: Limits, facts: ModelFacts):
        self.app, self.limits, self.facts = app, limits, facts
        self.running = 0  # admitted generation requests: one generating, the rest waiting for the model
        self.seconds = 1.0  # recent seconds per request (moving average), for Retry-After

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            scope, receive = await self._admit_checks(scope, receive)
        except ApiError as e:
            return await _send_error(send, e)
        except Exception:  # a bug in the checks: still one OpenAI-shaped 500, the traceback in the log
            print(f"serve: error checking {scope['method']} {scope['path']}:", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
            return await _send_error(send, ApiError(500, "The server had an error while processing your request.",
                                                    type="server_error"))
        if scope["path"] not in (CHAT, COMPLETIONS) or scope["method"] != "POST":
            return await self._forward(scope, receive, send)
        if self.running > self.limits.max_queue:  # one generating + max_queue waiting
            wait = max(1, math.ceil(self.seconds))
            return await _send_error(send, ApiError(
                429, f"The server is busy ({self.running} requests admitted, at most {self.limits.max_queue} wait "
                     f"behind the one generating); retry after {wait} s.", code="rate_limit_exceeded",
                type="requests", headers={"Retry-After": wait}))
        self.running += 1
        t0 = time.monotonic()
        try:
            await self._forward(scope, receive, send)
        finally:
            self.running -= 1
            self.seconds = 0.8 * self.seconds + 0.2 * (time.monotonic() - t0)

    async def _admit_checks(self, scope, receive):
        import anyio

        path, method = scope["path"], scope["method"]
        if path not in ROUTES:
            raise ApiError(404, f"Invalid URL ({method} {path}).")
        if method == "OPTIONS":  # CORS preflight: llama-cpp-python's CORS middleware answers it
            return scope, receive
        if method != ROUTES[path]:
            raise ApiError(405, f"Method not allowed ({method} {path}); use {ROUTES[path]}.")
        headers = dict(scope["headers"])
        if self.limits.api_key:
            if not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.limits.api_key}".encode()):
                raise ApiError(401, "Missing or incorrect API key (send 'Authorization: Bearer <key>').",
                               code="invalid_api_key")
        if method != "POST":
            return scope, receive
        raw = await self._read_body(headers, receive)
        check = check_chat if path == CHAT else check_completion
        body = check(parse_body(raw), self.limits)
        new = encode_body(body)
        await anyio.to_thread.run_sync(self.facts.check, path, body)
        scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-length"]
                     + [(b"content-length", str(len(new)).encode())])
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": new, "more_body": False}
            return await receive()  # then the client's disconnect, which llama-cpp-python and sse watch for

        return scope, replay

    async def _read_body(self, headers: dict, receive) -> bytes:
        limit = self.limits.max_request_bytes
        too_big = ApiError(413, f"The request body is larger than this server's limit of {limit // 1024} KiB.",
                           code="request_too_large")
        try:
            if int(headers.get(b"content-length", b"0")) > limit:
                raise too_big
        except ValueError:
            raise bad("Invalid Content-Length header.")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ApiError(400, "The client closed the request.")
            size += len(msg.get("body", b""))
            if size > limit:
                raise too_big
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return b"".join(chunks)

    async def _forward(self, scope, receive, send):
        """The app, with its response start held back until the first body part: an exception before then is
        still answered with a status code. Error bodies are buffered and reshaped."""
        import anyio

        state = {"start": None, "flushed": False, "error": []}
        flush_lock = anyio.Lock()  # sse_starlette's ping task may send beside its data task
        where = f"{scope['method']} {scope['path']}"

        async def held_send(msg):
            if msg["type"] == "http.response.start":
                state["start"] = msg
                return
            if msg["type"] != "http.response.body":
                return await send(msg)
            status = state["start"]["status"]
            if status >= 400:
                state["error"].append(msg.get("body", b""))
                if not msg.get("more_body"):
                    state["flushed"] = True
                    await _send_error(send, _shaped(status, b"".join(state["error"]), where))
                return
            async with flush_lock:
                if not state["flushed"]:
                    state["flushed"] = True
                    await send(state["start"])
            await send(msg)

        try:
            await self.app(scope, receive, held_send)
        except Exception:
            if state["flushed"]:
                raise  # mid-stream: the client sees the stream end; uvicorn logs the traceback
            print(f"serve: error before the first byte of {where}:", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
            await _send_error(send, ApiError(500, "The server had an error while processing your request.",
                                             type="server_error"))
