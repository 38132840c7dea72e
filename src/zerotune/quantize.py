"""`zerotune quantize RECIPE`: HF model -> GGUF with llama.cpp's own converter and quantizer.

q8_0 / f16 / bf16 / f32 come straight from `convert_hf_to_gguf.py` (the copy
shipped in the llama-cpp-python sdist we build the runtime from, so converter
and runtime are the same llama.cpp). K-quants go through an f16 GGUF and
llama.cpp's quantizer (`llama_model_quantize`, exposed by llama-cpp-python).
The result is read back and checked before it replaces an earlier GGUF.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import manifest as mf
from .config import REPO_ROOT, Recipe
from .errors import MissingInputError, UserError
from .gguf_checks import inspect_gguf
from .layout import layout, write_resolved_recipe
from .quant_types import QUANT_TYPES

CONVERTER = REPO_ROOT / "assets" / "llama.cpp" / "convert_hf_to_gguf.py"
CONVERTER_TYPES = {k for k, q in QUANT_TYPES.items() if q.producer == "converter"}
QUANTIZER_TYPES = {k: q.ftype for k, q in QUANT_TYPES.items() if q.producer == "quantizer"}


def run_converter(model_dir: Path, outtype: str, outfile: Path) -> None:
    if not CONVERTER.exists():
        raise MissingInputError(f"{CONVERTER} not found. Run `make setup` (it unpacks llama.cpp's converter).")
    cmd = [sys.executable, str(CONVERTER), str(model_dir), "--outtype", outtype, "--outfile", str(outfile)]
    print(f"quantize: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        hint = ""
        if "pre-tokenizer" in tail or "BPE pre-tokenizer was not recognized" in tail:
            hint = ("\nThe converter does not know this tokenizer's pre-tokenizer (llama.cpp #8649): "
                    "use the model's original tokenizer files, or a llama.cpp version that knows it.")
        raise RuntimeError(f"llama.cpp converter failed (exit {proc.returncode}):\n{tail}{hint}")


def run_quantizer(src: Path, dst: Path, qtype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTIZER_TYPES[qtype]
    params.nthread = os.cpu_count() or 1
    print(f"quantize: llama.cpp quantizer {src.name} -> {qtype}", flush=True)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc} for {src} -> {qtype}")


def quantize(r: Recipe, model_dir: Path | None = None) -> dict:
    qtype = r.quantize.type.lower()
    if qtype not in CONVERTER_TYPES | set(QUANTIZER_TYPES):
        raise UserError(f"quantize.type '{qtype}' is not supported. Use one of "
                         f"{sorted(CONVERTER_TYPES)} (converter) or {sorted(QUANTIZER_TYPES)} (quantizer).")
    model_dir = Path(model_dir or layout(r).model)
    if not (model_dir / "config.json").exists():
        raise MissingInputError(f"no trained model in {model_dir} (no config.json). Run `make finetune RECIPE={r.name}` first.")
    out = layout(r).gguf
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    f16 = out.with_name(out.stem + ".f16.tmp")
    try:
        if qtype in CONVERTER_TYPES:
            run_converter(model_dir, qtype, tmp)
        else:
            run_converter(model_dir, "f16", f16)
            run_quantizer(f16, tmp, qtype)
        report = inspect_gguf(tmp, model_dir, qtype)
        digest, size = mf.sha256(tmp), tmp.stat().st_size
    except BaseException:  # a failed or interrupted export leaves the earlier GGUF and no partial file
        tmp.unlink(missing_ok=True)
        raise
    finally:
        f16.unlink(missing_ok=True)
    mf.publish(tmp, out)  # an earlier GGUF is replaced only by one that passed its checks
    train_manifest = mf.read(layout(r).train_manifest) or {}
    data_manifest = mf.read(layout(r).data_manifest) or {}
    manifest = {"stage": "quantize", "recipe": r.name, "gguf": str(out), "type": qtype,
                "sha256": digest, "bytes": size, "source_model": str(model_dir),
                "source_model_sha256": train_manifest.get("model_sha256"),
                "data_fingerprint": data_manifest.get("fingerprint"), "checks": report}
    mf.write(layout(r).gguf_manifest, manifest)
    write_resolved_recipe(layout(r).gguf_dir, r)
    print(f"quantize: wrote {out} ({size / 2**20:.1f} MiB, {qtype}); checks passed: "
          f"{report['summary']}", flush=True)
    return manifest


