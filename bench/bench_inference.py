"""Inference benchmark: Q8_0 GGUF with llama-cpp-python vs transformers `generate`, same model, same machine.

    .venv/bin/python bench/bench_inference.py [--model runs/tiny/model]

Both run greedy decoding of the same number of new tokens from the same prompt, on all CPU threads,
alternating repeats; the ratio is measured in one run. With no trained model it benchmarks a random
model of the same tiny architecture (speed does not depend on the weights' values).
Writes bench/results/inference.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def random_tiny_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs/models/tiny_llama31.json"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(REPO / "assets/tokenizer/llama3_1")).save_pretrained(out)
    return out


def hf_speed(model_dir: Path, prompt_ids: list[int], n_new: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ids)
        t1 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                       pad_token_id=0)
        t2 = time.perf_counter()
    decode = (t2 - t1) - (t1 - t0)  # generate = prefill + n_new decode steps
    return {"prompt_tokens_per_s": len(prompt_ids) / (t1 - t0), "decode_tokens_per_s": n_new / decode}


def gguf_speed(gguf: Path, prompt_ids: list[int], n_new: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt_ids) + n_new + 8, verbose=False)
    try:
        t0 = time.perf_counter()
        llm.eval(prompt_ids)
        t1 = time.perf_counter()
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        for _ in range(n_new):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
    finally:
        llm.close()
    return {"prompt_tokens_per_s": len(prompt_ids) / (t1 - t0), "decode_tokens_per_s": n_new / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "runs/tiny/model"))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from zerotune.quantize import run_converter

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(a.model)
        if not (model_dir / "config.json").exists():
            model_dir = random_tiny_model(Path(tmp) / "model")
        gguf = Path(tmp) / "model-q8_0.gguf"
        run_converter(model_dir, "q8_0", gguf)
        prompt = [128000] + [1000 + (i * 37) % 20000 for i in range(a.prompt_tokens - 1)]
        runs = {"hf": [], "gguf": []}
        for _ in range(a.repeats):  # alternate so load drift hits both
            runs["hf"].append(hf_speed(model_dir, prompt, a.new_tokens))
            runs["gguf"].append(gguf_speed(gguf, prompt, a.new_tokens))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    res = {"model": str(model_dir), "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
           "repeats": a.repeats, "threads": os.cpu_count(), "median": med,
           "ratio_gguf_over_hf": {m: med["gguf"][m] / med["hf"][m] for m in med["hf"]}}
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference.json").write_text(json.dumps(res, indent=2) + "\n")
    md = ["| engine | prompt tok/s | decode tok/s |", "|---|---:|---:|"]
    for k, label in (("hf", "transformers generate (fp32)"), ("gguf", "llama-cpp-python Q8_0")):
        md.append(f"| {label} | {med[k]['prompt_tokens_per_s']:,.0f} | {med[k]['decode_tokens_per_s']:,.0f} |")
    r = res["ratio_gguf_over_hf"]
    md.append(f"| **ratio GGUF / HF** | **{r['prompt_tokens_per_s']:.2f}×** | **{r['decode_tokens_per_s']:.2f}×** |")
    (out / "inference.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
