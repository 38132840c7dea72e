"""What a request to `zerotune serve` goes through before llama-cpp-python sees it.

llama-cpp-python's server answers a wrong-typed field with HTTP 500 and its validation dump (server file paths included),
a streaming request that fails with 200 and an empty stream, and some requests by crashing the whole process: a
`grammar` without a `root` rule, an out-of-range token id in /extras/detokenize, a JSON schema with `maxLength: 30000`
(llama.cpp gets a NULL sampler, reads past its vocabulary, overflows its stack). `Guard` sits in front of it:

1. routes: only POST /v1/chat/completions, POST /v1/completions and GET /v1/models (+ CORS preflight); anything
   else is 404/405 (the /extras endpoints and embeddings are not served);
2. the API key, when one is set (401);
3. the body: at most serve.max_request_kb (413), UTF-8 JSON without NaN/Infinity (400);
4. the fields: llama-cpp-python's own request models in strict mode (the same types its routes use, so what
   passes here passes there), then zerotune's rules for what those types let through (`check_chat`,
   `check_completion`): unknown or unsupported parameters refused by name (`grammar` among them), ranges,
   max_tokens <= serve.max_tokens, JSON schemas that become grammars small enough to convert and parse;
5. the model: the chat template renders the conversation, the prompt fits the context, every grammar the
   request implies parses in llama.cpp (checked with the same parser, so none reaches the sampler as NULL);
6. admission: one request is generated at a time (llama-cpp-python's lock); at most serve.max_queue wait behind
   it, more get 429 with Retry-After (the recent time per request, so the next slot should be free by then).

Every error is one OpenAI-shaped body, `{"error": {"message", "type", "param", "code"}}`, naming the field. A response
llama-cpp-python fails to produce is held back until its first byte, so a streaming request that fails before its
first token gets a status code, not an empty 200; a 5xx never carries the exception text (it goes to the log).
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import re
import sys
import time
import traceback
import typing
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
ROUTES = {CHAT: "POST", COMPLETIONS: "POST", MODELS: "GET"}
# OpenAI parameters llama-cpp-python's request models do not declare, handled here and removed from the body
CHAT_ALIASES = {"max_completion_tokens", "stream_options", "parallel_tool_calls"}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; each one is a sort over the vocabulary per token
INT32 = 2**31 - 1
MAX_DEPTH = 64  # nesting of the request's JSON; a real one stays under 20, and every later step recurses over it
# A JSON schema that becomes a grammar (response_format.schema, the parameters of the tool tool_choice names):
# llama-cpp-python's converter writes lengths and counts out one by one (maxLength 10^8: an 800 MB grammar), and
# llama.cpp's parser refuses a bounded repetition of a few thousand and crashes on one of 30,000 (measured).
SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
MAX_SCHEMA_COUNT, MAX_SCHEMA_TOTAL, MAX_SCHEMA_BYTES = 1000, 10_000, 16 * 1024
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {m} or {m,n} in a pattern


class ApiError(Exception):
    """A request refused, with the status and OpenAI-shaped body it gets."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                     "code": self.code}}).encode()


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class Limits:
    alias: str  # the one model name served (/v1/models); a request naming another gets 404
    api_key: str | None
    max_request_bytes: int
    max_tokens: int
    max_queue: int


# --- 3. the body --------------------------------------------------------------------------------------------

def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e999 parses to inf: no sampler parameter means that
        raise ValueError(f"number out of range: {text[:40]}")
    return x


def _no_constant(name: str):  # NaN, Infinity: Python's json takes them, JSON does not
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("The request body is not UTF-8.")
    try:
        body = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        body = None
    except ValueError as e:  # JSONDecodeError included: its message names line and column, nothing of ours
        raise bad(f"The request body is not valid JSON: {e}")
    level, depth = [body], 0
    while level:  # breadth first, so no recursion here either
        depth += 1
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
    if body is None and text.strip() != "null" or depth > MAX_DEPTH:
        raise bad(f"The request body is nested too deeply (at most {MAX_DEPTH} levels).")
    return body


def encode_body(body: dict) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a "\ud800" escape: a lone surrogate, which llama.cpp's tokenizer cannot take
        raise bad("The request contains invalid Unicode (a lone surrogate escape).")


# --- 4. the fields ------------------------------------------------------------------------------------------

@functools.cache
def _message_types() -> dict:
    """role -> a validator of llama-cpp-python's TypedDict for a message with that role (its own union)."""
    from llama_cpp import llama_types
    from pydantic import TypeAdapter

    return {typing.get_args(typing.get_type_hints(t)["role"])[0]: TypeAdapter(t)
            for t in typing.get_args(llama_types.ChatCompletionRequestMessage)}


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _from_pydantic(e, data: Any, prefix: tuple = ()) -> ApiError:
    """One message from pydantic's errors: the deepest field they name in the request (union-member tags such
    as 'list[str]' are skipped by walking the request itself), and what each union member expected there."""
    found = []
    for err in e.errors(include_url=False):
        node, path = data, []
        for i, part in enumerate(err["loc"]):
            if isinstance(node, dict) and part in node:
                node, path = node[part], path + [part]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node, path = node[part], path + [part]
            elif err["type"] == "missing" and i == len(err["loc"]) - 1:
                path.append(part)
        found.append((len(path), _path(prefix + tuple(path)), err))
    depth = max(d for d, _, _ in found)
    here = [(p, err) for d, p, err in found if d == depth]
    param = here[0][0]
    if all(err["type"] == "missing" for _, err in here):
        return bad(f"Missing required parameter: '{param}'.", param)
    msgs = list(dict.fromkeys(err["msg"] for _, err in here if err["type"] != "missing"))
    return bad(f"Invalid value for '{param}': {' or '.join(msgs)}.", param)


def _validate(model, data: dict, prefix: tuple = ()):
    from pydantic import TypeAdapter, ValidationError

    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data, strict=True)
        return model.model_validate(data, strict=True)  # strict: "0.5" is not a number, "yes" not a boolean
    except ValidationError as e:
        raise _from_pydantic(e, data, prefix)


def _text(content, where: str):
    """Message content as a string: text parts joined with a newline (as vLLM does); images refused."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"Invalid value for '{where}[{j}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                      f"are supported; this model takes no images.", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise bad("Invalid value for 'messages': expected a non-empty array of messages.", "messages")
    types, out = _message_types(), []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"Invalid value for '{where}': expected an object with 'role' and 'content'.", where)
        m = dict(m)
        if m.get("role") == "developer":  # OpenAI's newer name for the system turn
            m["role"] = "system"
        if not isinstance(m.get("role"), str) or m["role"] not in types:  # a dict or list is no role (nor hashable)
            raise bad(f"Invalid value for '{where}.role': {json.dumps(m.get('role'))[:40]} is not one of "
                      f"{sorted([*types, 'developer'])}.", f"{where}.role")
        if m["role"] == "assistant":
            if m.get("content", "") is None:
                del m["content"]  # OpenAI's tool-call turn has content null; llama-cpp-python's type wants it absent
        elif m.get("content") is None:  # llama-cpp-python's types allow null, which a template renders as "None"
            raise bad(f"Missing required parameter: '{where}.content' (a string).", f"{where}.content")
        if "content" in m:
            m["content"] = _text(m["content"], f"{where}.content")
        _validate(types[m["role"]], m, ("messages", i))
        if m["role"] == "assistant" and "content" not in m and not m.get("tool_calls"):
            raise bad(f"Missing required parameter: '{where}.content' (an assistant turn needs content or "
                      f"tool_calls).", f"{where}.content")
        out.append(m)
    return out


def _unknown(body: dict, known: set) -> None:
    for key in body:
        if key not in known:
            raise bad(f"Unrecognized request argument supplied: {key}", key)


def _common(body: dict, limits: Limits, default_cap: bool) -> None:
    """Rules shared by both generation endpoints, on the request as llama-cpp-python typed it."""
    if body.get("grammar") is not None:  # 10^5 nested groups or chained rules crash llama.cpp's parser (measured)
        raise bad("'grammar' (a llama.cpp extension) is not accepted here: llama.cpp's grammar parser can be crashed "
                  "by a hostile grammar. Use response_format {\"type\": \"json_object\", \"schema\": ...} or a "
                  "tool_choice naming a function.", "grammar")
    model = body.get("model")
    if model is None:
        body["model"] = limits.alias  # else the answer's "model" is the GGUF's path on the server
    elif model != limits.alias:
        raise ApiError(404, f"The model '{str(model)[:80]}' does not exist; this server serves '{limits.alias}'.",
                       "model", "model_not_found")
    # OpenAI's API has no repetition penalty; llama-cpp-python's request models default it to 1.1, which changes
    # even greedy answers (SmolLM2 + LoRA: 4 of 20 task answers differed from `zerotune check`'s, which llama.cpp
    # gives at 1.0). What a client does not ask for it does not get: the answers served are the ones checked.
    body.setdefault("repeat_penalty", 1.0)
    if body.get("n") not in (None, 1):
        raise bad(f"Invalid value for 'n': this server returns one choice per request (n=1); got {body['n']}.", "n")
    if body.get("best_of") not in (None, 1):
        raise bad(f"Invalid value for 'best_of': only 1 is supported; got {body['best_of']}.", "best_of")
    mt = body.get("max_tokens")
    if mt is None and (default_cap or "max_tokens" in body):
        body["max_tokens"] = limits.max_tokens  # llama-cpp-python reads none as "until the context is full"
    elif mt is not None and not 1 <= mt <= limits.max_tokens:
        raise bad(f"Invalid value for 'max_tokens': {mt} is outside 1..{limits.max_tokens} "
                  f"(this server's limit).", "max_tokens")
    if not 0 <= body.get("temperature", 0) <= 2:
        raise bad(f"Invalid value for 'temperature': {body['temperature']} is outside 0..2.", "temperature")
    seed = body.get("seed")
    if seed is not None and not 0 <= seed < 2**32:  # llama.cpp's seed is a uint32
        raise bad(f"Invalid value for 'seed': {seed} is outside 0..{2**32 - 1}.", "seed")
    for key, top in (("top_k", INT32), ("min_tokens", INT32), ("logprobs", MAX_TOP_LOGPROBS),
                     ("top_logprobs", MAX_TOP_LOGPROBS)):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= top:
            raise bad(f"Invalid value for '{key}': {v} is outside 0..{top}.", key)
    bias = body.get("logit_bias")
    if bias and body.get("logit_bias_type") != "tokens":
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit()):
                raise bad(f"Invalid value for 'logit_bias': keys are token ids; got {k[:40]!r}.", "logit_bias")
            if not -100 <= v <= 100:
                raise bad(f"Invalid value for 'logit_bias': bias {v} for token {k} is outside -100..100.",
                          "logit_bias")


def _schema_counts(node, path: str):
    """(where, n) for every length or count a JSON schema asks for: the keywords, and {m,n} in patterns."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in SCHEMA_COUNTS and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{path}.{k}", v
            elif k == "pattern" and isinstance(v, str):
                for m in _REPEAT.finditer(v):
                    yield f"{path}.pattern", max(int(x) if len(x) < 10 else 10**10 for x in m.groups() if x)
            else:
                yield from _schema_counts(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _schema_counts(v, f"{path}[{i}]")


def check_grammar_schema(schema, param: str) -> None:
    """A schema llama-cpp-python will turn into a grammar is small enough for its converter and llama.cpp."""
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise bad(f"Invalid value for '{param}': a schema that constrains the answer may take at most "
                  f"{MAX_SCHEMA_BYTES // 1024} KiB as JSON.", param)
    total = 0
    for where, n in _schema_counts(schema, param):
        total += n
        if n > MAX_SCHEMA_COUNT or total > MAX_SCHEMA_TOTAL:
            raise bad(f"Invalid value for '{where}': {n} is over this server's limit for a schema that constrains "
                      f"the answer (each length or count at most {MAX_SCHEMA_COUNT}, all together at most "
                      f"{MAX_SCHEMA_TOTAL}); llama.cpp builds a grammar rule for each one.", where)


def check_chat(body: Any, limits: Limits) -> dict:
    """A chat request as llama-cpp-python will receive it (normalized), or ApiError naming the field."""
    from llama_cpp.server.types import CreateChatCompletionRequest

    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    _unknown(body, set(CreateChatCompletionRequest.model_fields) | CHAT_ALIASES)
    if "messages" not in body:
        raise bad("Missing required parameter: 'messages'.", "messages")
    body = dict(body, messages=_messages(body["messages"]))
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise bad(f"'{key}' is deprecated by OpenAI and not supported here: use 'tools' and 'tool_choice'.", key)
    mct = body.pop("max_completion_tokens", None)
    if mct is not None:
        if body.get("max_tokens") not in (None, mct):
            raise bad("Give 'max_tokens' or 'max_completion_tokens', not both with different values.",
                      "max_completion_tokens")
        body["max_tokens"] = mct
    opts = body.pop("stream_options", None)
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or opts.get("include_usage") not in (None, False)):
        raise bad("Invalid value for 'stream_options': only {\"include_usage\": false} is supported "
                  "(streamed answers carry no usage chunk).", "stream_options")
    ptc = body.pop("parallel_tool_calls", None)  # at most one call per answer satisfies either value
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("Invalid value for 'parallel_tool_calls': expected a boolean.", "parallel_tool_calls")
    for i, tool in enumerate(body["tools"] if isinstance(body.get("tools"), list) else []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and "parameters" not in fn:  # OpenAI: omitted = takes no arguments
            body["tools"][i] = dict(tool, function=dict(fn, parameters={"type": "object", "properties": {}}))
    req = _validate(CreateChatCompletionRequest, body)
    _common(body, limits, default_cap=True)
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise bad("'tool_choice' is only allowed when 'tools' are given.", "tool_choice")
    if choice == "required":  # llama-cpp-python renders it into the prompt but does not enforce it
        raise bad("tool_choice 'required' is not enforced by this server: name the function instead, "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    if isinstance(choice, dict):
        names = [t["function"]["name"] for t in req.tools]
        if choice["function"]["name"] not in names:
            raise bad(f"Invalid value for 'tool_choice': no tool named {choice['function']['name']!r} in 'tools'.",
                      "tool_choice.function.name")
        i = names.index(choice["function"]["name"])
        check_grammar_schema(req.tools[i]["function"]["parameters"], f"tools[{i}].function.parameters")
    if req.response_format and "schema" in req.response_format:
        check_grammar_schema(req.response_format["schema"], "response_format.schema")
    return body


def check_completion(body: Any, limits: Limits) -> dict:
    from llama_cpp.server.types import CreateCompletionRequest

    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    _unknown(body, set(CreateCompletionRequest.model_fields))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if (prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)) or \
                any(isinstance(p, list) for p in prompt):
            raise bad("Invalid value for 'prompt': token-id prompts are not supported by this server; send the "
                      "prompt as a string.", "prompt")
        if len(prompt) > 1:
            raise bad("Invalid value for 'prompt': one prompt per request (batches of prompts are not supported).",
                      "prompt")
        if prompt:
            body = dict(body, prompt=prompt[0])  # llama-cpp-python unwraps a one-item list the same way
    if body.get("prompt") in (None, "", []):
        raise bad("Missing required parameter: 'prompt' (a non-empty string).", "prompt")
    if body.get("suffix") is not None:  # llama-cpp-python 0.3.36 inserts token 0 for it ("TODO: Fix")
        raise bad("'suffix' (insert mode) is not supported by this server.", "suffix")
    _validate(CreateCompletionRequest, body)
    _common(body, limits, default_cap=False)
    return body


# --- 5. the model -------------------------------------------------------------------------------------------

class ModelFacts:
    """What the checks need from the loaded model: its chat template (rendered as llama-cpp-python's handler
    renders it), its tokenizer, context and vocabulary, and llama.cpp's grammar parser."""

    def __init__(self, llm):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm, self.n_ctx = llm, llm.n_ctx()
        self.vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        eos, bos = llm.token_eos(), llm.token_bos()
        # built exactly as Llama.__init__ builds the "chat_template.default" handler's formatter (llama.py)
        text = {t: llm._model.token_get_text(t) if t != -1 else "" for t in (eos, bos)}
        self.formatter = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token=text[eos],
                                             bos_token=text[bos], stop_token_ids=[eos])

    def grammar_parses(self, grammar) -> bool:
        import llama_cpp
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar._grammar.encode("utf-8"),
                                                       grammar._root.encode("utf-8"))
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def check(self, path: str, body: dict) -> None:
        """Template, context and grammars, as llama-cpp-python will meet them; runs in a worker thread."""
        from llama_cpp import llama_chat_format

        grammars = []
        if path == CHAT:
            try:
                prompt = self.formatter(messages=body["messages"], tools=body.get("tools"),
                                        tool_choice=body.get("tool_choice")).prompt
            except Exception as e:  # raise_exception() in the template, or a jinja error on this conversation
                raise bad(f"The model's chat template cannot render these messages: {str(e)[:300]}", "messages")
            tokens = self.llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)  # as the handler does
            rf = body.get("response_format")
            if rf:
                grammars.append(("response_format", llama_chat_format._grammar_for_response_format(rf)))
            choice = body.get("tool_choice")
            if isinstance(choice, dict):
                tool = next(t for t in body["tools"] if t["function"]["name"] == choice["function"]["name"])
                # the handler's own fallback: a schema the converter rejects becomes plain JSON
                grammars.append(("tool_choice", llama_chat_format._grammar_for_json_schema(
                    json.dumps(tool["function"]["parameters"]))))
            where = "messages"
        else:
            tokens = self.llm.tokenize(body["prompt"].encode("utf-8"), add_bos=True, special=True)
            where = "prompt"
        if len(tokens) >= self.n_ctx:
            raise bad(f"This model's maximum context length is {self.n_ctx} tokens; the prompt "
                      f"{'built from the messages ' if path == CHAT else ''}is {len(tokens)} tokens.", where,
                      "context_length_exceeded")
        for param, g in grammars:
            if g is not None and not self.grammar_parses(g):
                raise bad(f"Invalid value for '{param}': llama.cpp cannot parse the grammar this schema becomes "
                          f"(it refuses long repetitions, among others).", param)
        bias = body.get("logit_bias")
        if bias and body.get("logit_bias_type") != "tokens":
            for k in bias:
                if int(k) >= self.n_vocab:
                    raise bad(f"Invalid value for 'logit_bias': token id {k} is outside the vocabulary "
                              f"(0..{self.n_vocab - 1}).", "logit_bias")


# --- the ASGI middleware ------------------------------------------------------------------------------------

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
