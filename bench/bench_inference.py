"""Inference benchmark: Q8_0 GGUF with llama-cpp-python vs transformers `generate`, same model, same machine.

    .venv/bin/python bench/bench_inference.py [--model runs/tiny/model]

Both run greedy decoding of the same number of new tokens from the same prompt, on one thread each by default
(`--threads`): this compares the engines' kernels per core. With their default thread pools on this 2-vCPU
VM, identical calls scattered by up to 3x (llama.cpp: a 128-token prefill took 5.1-28.8 ms over 30 calls at
2 threads, 5.9-10.1 ms at 1), so more threads measured the scheduler more than the engines. On the T4
target the GPU does this work; these CPU figures are context, not a T4 prediction.

HF prefill is timed with logits for the last position only (as generate() and llama.cpp compute them).
Each measurement runs in its own fresh process (in one process torch's OpenMP workers kept spinning and
slowed llama.cpp at random). Prefill is timed `--prefills` times after a warm-up and decode `--decodes` times
(medians); the engines alternate `--repeats` times, each ratio is taken within a repeat and reported as the
median over repeats with its spread. With no trained model it benchmarks a random model of the same tiny
architecture (speed does not depend on the weights' values).
Writes bench/results/inference.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from bench_stats import Steal, fmt_ratio, pct, ratio_stats  # noqa: E402

LABELS = {"hf": "transformers generate (fp32)", "gguf": "llama-cpp-python Q8_0"}


def random_tiny_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs/models/tiny_llama31.json"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(REPO / "assets/tokenizer/llama3_1")).save_pretrained(out)
    return out


def hf_speed(model_dir: Path, prompt_ids: list[int], n_new: int, prefills: int, decodes: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])

    def generate(n):
        model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        generate(4)  # warm-up: first-call costs
        # logits for the last position only, as generate() and llama.cpp compute them: full logits would
        # multiply the prompt by the 128k-row LM head, which dominates a tiny model's prefill
        prefill = _median_time(lambda: model(input_ids=ids, logits_to_keep=1), prefills)
        one, full = _median_time(lambda: generate(1), decodes), _median_time(lambda: generate(n_new), decodes)
    # generate(n) = prefill + n - 1 decode steps (the first new token comes from the prefill's logits)
    return {"prompt_tokens_per_s": len(prompt_ids) / prefill, "decode_tokens_per_s": (n_new - 1) / (full - one),
            "threads": torch.get_num_threads()}


def gguf_speed(gguf: Path, prompt_ids: list[int], n_new: int, prefills: int, decodes: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt_ids) + n_new + 8, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def prefill():
        llm.reset()  # empty the KV cache so every prefill processes the whole prompt
        llm.eval(prompt_ids)

    def decode():
        prefill()
        t0 = time.perf_counter()
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        for _ in range(n_new - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return time.perf_counter() - t0

    try:
        prefill()  # warm-up
        t = _median_time(prefill, prefills)
        d = statistics.median(decode() for _ in range(decodes))
        threads = {"threads": llm.n_threads, "threads_batch": llm.n_threads_batch}
    finally:
        llm.close()
    return {"prompt_tokens_per_s": len(prompt_ids) / t, "decode_tokens_per_s": (n_new - 1) / d, **threads}


def _median_time(fn, k: int) -> float:
    """Median of k timings: one prefill of a tiny model takes milliseconds, so a single timing is mostly jitter."""
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _in_fresh_process(engine: str, path: Path, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--path", str(path), "--prompt-tokens", str(a.prompt_tokens),
           "--new-tokens", str(a.new_tokens), "--prefills", str(a.prefills), "--decodes", str(a.decodes),
           "--threads", str(a.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_inference: the {engine} worker failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "runs/tiny/model"))
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefills", type=int, default=20, help="timed prefills per repeat (median)")
    ap.add_argument("--decodes", type=int, default=5, help="timed decodes per repeat (median)")
    ap.add_argument("--threads", type=int, default=1, help="threads for both engines (see the module docstring)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for inference.json/.md")
    ap.add_argument("--worker", choices=sorted(LABELS), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    prompt = [128000] + [1000 + (i * 37) % 20000 for i in range(a.prompt_tokens - 1)]
    if a.worker:
        fn = hf_speed if a.worker == "hf" else gguf_speed
        print(json.dumps(fn(Path(a.path), prompt, a.new_tokens, a.prefills, a.decodes, a.threads)))
        return
    from zerotune.quantize import run_converter

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(a.model)
        if not (model_dir / "config.json").exists():
            model_dir = random_tiny_model(Path(tmp) / "model")
        gguf = Path(tmp) / "model-q8_0.gguf"
        run_converter(model_dir, "q8_0", gguf)
        runs, steal = {"hf": [], "gguf": []}, []
        for rep in range(a.repeats):  # alternate so load drift hits both
            st = Steal()
            runs["hf"].append(_in_fresh_process("hf", model_dir, a))
            runs["gguf"].append(_in_fresh_process("gguf", gguf, a))
            steal.append(st.fraction())
            print(f"bench_inference: repeat {rep + 1}/{a.repeats}: " + ", ".join(
                f"{m} {runs['gguf'][-1][m] / runs['hf'][-1][m]:.2f}x" for m in ("prompt_tokens_per_s",
                                                                                "decode_tokens_per_s")), flush=True)
    metrics = ("prompt_tokens_per_s", "decode_tokens_per_s")
    med = {k: {m: statistics.median(r[m] for r in v) for m in metrics} for k, v in runs.items()}
    ratio = {m: ratio_stats([g[m] / h[m] for h, g in zip(runs["hf"], runs["gguf"])]) for m in metrics}
    res = {"model": str(model_dir), "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
           "repeats": a.repeats, "prefills_per_repeat": a.prefills, "decodes_per_repeat": a.decodes,
           "cpus": os.cpu_count(), "median": med, "ratio_gguf_over_hf": ratio, "runs": runs,
           "cpu_steal_per_repeat": steal}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference.json").write_text(json.dumps(res, indent=2) + "\n")
    hf_t, gg = runs["hf"][0]["threads"], runs["gguf"][0]
    md = ["| engine | threads | prompt tok/s | decode tok/s |", "|---|---|---:|---:|",
          f"| {LABELS['hf']} | {hf_t} | {med['hf']['prompt_tokens_per_s']:,.0f} | "
          f"{med['hf']['decode_tokens_per_s']:,.0f} |",
          f"| {LABELS['gguf']} | {gg['threads']} decode, {gg['threads_batch']} prompt | "
          f"{med['gguf']['prompt_tokens_per_s']:,.0f} | {med['gguf']['decode_tokens_per_s']:,.0f} |",
          f"| **ratio GGUF / HF** | | **{ratio['prompt_tokens_per_s']['median']:.2f}x** | "
          f"**{ratio['decode_tokens_per_s']['median']:.2f}x** |",
          "", f"{a.prompt_tokens}-token prompt, {a.new_tokens} greedy new tokens, {a.threads} thread(s) per engine "
          f"({os.cpu_count()} CPUs; see bench_inference.py on why). Per repeat each engine runs in a fresh process: prefill timed {a.prefills} times, decode "
          f"{a.decodes} times (medians); {a.repeats} alternating repeats, ratio taken within each repeat:", ""]
    md += [f"- {m.replace('_', ' ')}: {fmt_ratio(ratio[m])}" for m in metrics]
    md += [f"- CPU steal per repeat (hypervisor, /proc/stat): "
           + ", ".join(pct(x) for x in steal)]
    (out / "inference.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
