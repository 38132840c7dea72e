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

What a request must be, the limits (serve.max_request_kb, serve.max_tokens, serve.max_queue) and the error shape
are serve_guard.py's (and the modules it names): it stands in front of llama-cpp-python's app.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .chat_template import CHAT_FORMAT
from .config import Recipe
from .errors import MissingInputError, UserError
from .gguf_checks import chat_template_of
from .layout import layout
from .serve_guard import Guard
from .serve_model_checks import ModelFacts
from .serve_request import Limits


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
    from llama_cpp.server import app as server_app
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
    llm = server_app._llama_proxy._current_model  # loaded by create_app
    app.add_middleware(Guard, facts=ModelFacts(llm), limits=Limits(
        alias=r.name, api_key=api_key, max_request_bytes=r.serve.max_request_kb * 1024,
        max_tokens=r.serve.max_tokens, max_queue=r.serve.max_queue))
    return app, server


def return_large_frees_to_the_os() -> None:
    """A fixed glibc mmap threshold, so that large buffers freed after each request leave the process.

    glibc raises its mmap threshold after the first large free (up to 32 MiB); from then on the large buffers
    llama.cpp allocates and frees while generating come from heaps that keep them. Measured on the tiny GGUF
    (128k vocabulary), six rounds of 100 concurrent requests took the server from 461 to 898 MiB RSS, and
    malloc_trim gave back all but 16 MiB of the growth: freed memory, not a leak. With the threshold fixed at
    128 KiB, RSS rose once to about 620 MiB and stayed there, at the same speed. Nothing to do off glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_MMAP_THRESHOLD = -3  # malloc.h
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def serve(r: Recipe) -> int:
    import uvicorn

    return_large_frees_to_the_os()
    app, server = build_app(r)
    if server.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        print(f"serve: WARNING: listening on {server.host} without an API key; set ZEROTUNE_API_KEY.", flush=True)
    s = r.serve
    print(f"serve: {layout(r).gguf.name} as model '{r.name}' on http://{server.host}:{server.port}/v1 "
          f"(context {s.n_ctx}, GPU layers {s.n_gpu_layers}); Ctrl-C stops it", flush=True)
    print(f"serve: limits: request body {s.max_request_kb} KiB, max_tokens {s.max_tokens}, one answer at a time "
          f"with {s.max_queue} waiting (then 429)", flush=True)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info")  # handles SIGINT/SIGTERM gracefully
    return 0
