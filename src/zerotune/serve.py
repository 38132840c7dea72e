"""`zerotune serve RECIPE`: llama-cpp-python's OpenAI-compatible server over the recipe's GGUF.

Chat completions, completions, models and streaming come from llama-cpp-python.
zerotune sets what its defaults get wrong for a fine-tuned model: loopback by
default; `interrupt_requests` off, so a streaming answer is not cut short when
another request arrives (#867); a GGUF without an embedded chat template is
refused rather than served with a guessed "llama-2" format; an optional API key
(ZEROTUNE_API_KEY in the environment, or serve.api_key).
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import Recipe
from .quantize import gguf_path


class ServeError(RuntimeError):
    pass


def require_chat_template(gguf: Path) -> None:
    from gguf import GGUFReader, Keys

    field = GGUFReader(str(gguf)).fields.get(Keys.Tokenizer.CHAT_TEMPLATE)
    if field is None or not field.contents():
        raise ServeError(f"{gguf} has no embedded chat template ({Keys.Tokenizer.CHAT_TEMPLATE}); llama-cpp-python would "
                         "silently fall back to the 'llama-2' format. Re-export with `make quantize` from a model whose "
                         "tokenizer has a chat template.")


def build_app(r: Recipe, gguf: Path | None = None):
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    gguf = Path(gguf or gguf_path(r))
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} not found. Run `make quantize RECIPE={r.name}` first.")
    require_chat_template(gguf)
    api_key = os.environ.get("ZEROTUNE_API_KEY") or r.serve.api_key
    server = ServerSettings(host=r.serve.host, port=r.serve.port, interrupt_requests=False, api_key=api_key)
    model = ModelSettings(model=str(gguf), model_alias=r.name, n_ctx=r.serve.n_ctx,
                          n_gpu_layers=r.serve.n_gpu_layers, verbose=False)
    return create_app(server_settings=server, model_settings=[model]), server


def serve(r: Recipe) -> int:
    import uvicorn

    app, server = build_app(r)
    if server.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        print(f"serve: WARNING: listening on {server.host} without an API key; set ZEROTUNE_API_KEY.", flush=True)
    print(f"serve: {gguf_path(r).name} as model '{r.name}' on http://{server.host}:{server.port}/v1 "
          f"(context {r.serve.n_ctx}, GPU layers {r.serve.n_gpu_layers}); Ctrl-C stops it", flush=True)
    uvicorn.run(app, host=server.host, port=server.port, log_level="info")  # handles SIGINT/SIGTERM gracefully
    return 0
