"""`zerotune serve RECIPE`: llama-cpp-python's OpenAI-compatible server over the recipe's GGUF.

Chat completions, completions, models and streaming come from llama-cpp-python.
zerotune sets what its defaults get wrong for a fine-tuned model: loopback by
default; `interrupt_requests` off, so a streaming answer is not cut short when
another request arrives (#867); a GGUF without an embedded chat template is
refused rather than served with a guessed "llama-2" format, and an embedded one
is always used as is (`chat_format` "chat_template.default": llama-cpp-python
would otherwise swap a Llama-3 template it recognises for its own formatter,
which does not trim messages as the template does); an optional API key
(ZEROTUNE_API_KEY in the environment, or serve.api_key). The model is closed
when the server shuts down (llama-cpp-python's `__del__` at exit raises).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .config import Recipe
from .errors import MissingInputError, UserError
from .gguf_checks import CHAT_FORMAT, chat_template_of
from .layout import layout


REQUIRED_FIELDS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


class ServeError(UserError, RuntimeError):
    pass


def require_chat_template(gguf: Path) -> None:
    from gguf import Keys

    if not chat_template_of(gguf):  # raises GGUFCheckError naming the file if it is damaged
        raise ServeError(f"{gguf} has no embedded chat template ({Keys.Tokenizer.CHAT_TEMPLATE}); llama-cpp-python would "
                         "silently fall back to the 'llama-2' format. Re-export with `make quantize` from a model whose "
                         "tokenizer has a chat template.")


def close_model() -> None:
    """Close the model llama-cpp-python's server holds (a module-level proxy), if any."""
    from llama_cpp.server import app as server_app

    proxy = getattr(server_app, "_llama_proxy", None)
    llm = getattr(proxy, "_current_model", None) if proxy is not None else None
    if llm is not None:
        llm.close()
        proxy._current_model = None
        proxy._current_model_alias = None


def build_app(r: Recipe, gguf: Path | None = None):
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    gguf = Path(gguf or layout(r).gguf)
    if not gguf.exists():
        raise MissingInputError(f"{gguf} not found. Run `make quantize RECIPE={r.name}` first.")
    require_chat_template(gguf)
    api_key = os.environ.get("ZEROTUNE_API_KEY") or r.serve.api_key
    server = ServerSettings(host=r.serve.host, port=r.serve.port, interrupt_requests=False, api_key=api_key)
    model = ModelSettings(model=str(gguf), model_alias=r.name, n_ctx=r.serve.n_ctx, chat_format=CHAT_FORMAT,
                          n_gpu_layers=r.serve.n_gpu_layers, verbose=False)
    close_model()  # llama-cpp-python keeps one server model per process: close an earlier app's
    app = create_app(server_settings=server, model_settings=[model])

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            yield
        finally:
            close_model()

    app.router.lifespan_context = lifespan

    async def invalid_json(_request, exc: json.JSONDecodeError):
        # llama-cpp-python's route error handler re-reads the body as JSON and lets this escape as a 500.
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=400, content={"error": {
            "message": f"request body is not valid JSON: {exc}", "type": "invalid_request_error", "code": None}})

    app.add_exception_handler(json.JSONDecodeError, invalid_json)

    @app.middleware("http")
    async def require_fields(request, call_next):
        # llama-cpp-python defaults `messages` to [] and `prompt` to "": a request missing them would be
        # answered from an empty prompt. OpenAI requires both.
        need = REQUIRED_FIELDS.get(request.url.path) if request.method == "POST" else None
        if need:
            try:
                body = json.loads(await request.body() or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None  # the JSON handler above answers it
            else:
                if not isinstance(body, dict) or body.get(need) in (None, [], ""):
                    from fastapi.responses import JSONResponse

                    return JSONResponse(status_code=400, content={"error": {
                        "message": f"'{need}' is required and must not be empty", "type": "invalid_request_error",
                        "param": need, "code": None}})
        return await call_next(request)

    return app, server


def serve(r: Recipe) -> int:
    import uvicorn

    app, server = build_app(r)
    if server.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        print(f"serve: WARNING: listening on {server.host} without an API key; set ZEROTUNE_API_KEY.", flush=True)
    print(f"serve: {layout(r).gguf.name} as model '{r.name}' on http://{server.host}:{server.port}/v1 "
          f"(context {r.serve.n_ctx}, GPU layers {r.serve.n_gpu_layers}); Ctrl-C stops it", flush=True)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info")  # handles SIGINT/SIGTERM gracefully
    return 0
