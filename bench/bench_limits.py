"""What this machine can physically do, measured in the same run as the benchmarks that are compared with it.

    .venv/bin/python bench/bench_limits.py [--model assets/models/smollm2-135m-instruct]

- fp32 matmul throughput at the model's own shapes: torch.matmul of (tokens x in) @ (in x out) for every
  linear layer of one decoder layer plus the LM head, forward (x W) and the two backward products
  (dY W^T, X^T dY), timed over ~`--seconds` each; the figure is the FLOPs-weighted mix, i.e. the time the
  model's matmuls would take at that speed. Measured on one thread, and in one single-thread process per core
  at the same time (what training's ranks do: torchrun gives each OMP_NUM_THREADS=1), which is the machine's
  training limit.
- Memory bandwidth, one thread, over a buffer far larger than the caches: bytes read per second, the faster of
  a matrix-vector product (a decode step's access pattern) and a numpy sum (llama.cpp's single-thread decode
  reads every weight once per token, so this is its limit); and a numpy copy (read + write bytes per second).

Used by bench_train.py and bench_inference.py (which call measure() at their start), and on its own it prints
and writes bench/results/limits.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"


def model_matmuls(config: dict, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of every forward matmul of one decoder layer and of the LM head, for `tokens` rows."""
    h, f = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads) * hd
    return [("q_proj", tokens, h, heads * hd), ("k_proj", tokens, h, kv), ("v_proj", tokens, h, kv),
            ("o_proj", tokens, heads * hd, h), ("gate_proj", tokens, h, f), ("up_proj", tokens, h, f),
            ("down_proj", tokens, f, h), ("lm_head", tokens, h, config["vocab_size"])]


def forward_flops_per_token(config: dict) -> float:
    """2 x the weights every token multiplies (all layers and the LM head); attention scores left out."""
    per_layer = sum(k * n for name, _, k, n in model_matmuls(config, 1) if name != "lm_head")
    return 2.0 * (config["num_hidden_layers"] * per_layer + config["hidden_size"] * config["vocab_size"])


def _time_matmul(m: int, k: int, n: int, seconds: float) -> tuple[float, float]:
    """FLOPs per wall-second and per CPU-second of forward + both backward products at this shape, medians of
    short bursts (CPU time leaves out what the hypervisor stole)."""
    import torch

    x, w, dy = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    products = [lambda: x @ w, lambda: dy @ w.T, lambda: x.T @ dy]
    for p in products:
        p()  # first-call costs (packing buffers, page faults)
    wall, cpu, t_end = [], [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(wall) < 3:
        t0, c0 = time.perf_counter(), time.thread_time()
        for p in products:
            p()
        wall.append(3 * 2 * m * k * n / (time.perf_counter() - t0))
        cpu.append(3 * 2 * m * k * n / max(time.thread_time() - c0, 1e-9))
    return statistics.median(wall), statistics.median(cpu)


def matmul_rate(config: dict, tokens: int, seconds: float) -> dict:
    """One thread: FLOPs/s per shape and the FLOPs-weighted mix (total FLOPs / total time at the measured rates),
    per wall-second and per CPU-second."""
    import torch

    torch.set_num_threads(1)
    per, flops, wall_s, cpu_s = {}, 0.0, 0.0, 0.0
    for name, m, k, n in model_matmuls(config, tokens):
        wall, cpu = _time_matmul(m, k, n, seconds)
        per[name] = wall
        flops += 6 * m * k * n
        wall_s += 6 * m * k * n / wall
        cpu_s += 6 * m * k * n / cpu
    return {"per_shape_flops_per_s": per, "mix_flops_per_s": flops / wall_s, "mix_flops_per_cpu_s": flops / cpu_s}


def _matmul_child(args) -> dict:
    config, tokens, seconds = args
    return matmul_rate(config, tokens, seconds)


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """Single thread. read: a matrix-vector product over a fp32 matrix far larger than the caches (the access
    pattern of a decode step: every weight read once, two FLOPs each), so bytes read per second; copy: numpy
    copy of the same bytes (read + write)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    w = torch.ones(mib * 2**20 // 4 // 8192, 8192)
    v = torch.ones(8192)
    src = w.numpy().reshape(-1)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # every page touched once before timing
    torch.mv(w, v)
    kinds = {"read_mv": (lambda: torch.mv(w, v), src.nbytes), "read_sum": (src.sum, src.nbytes),
             "copy": (lambda: np.copyto(dst, src), 2 * src.nbytes)}
    out: dict = {f"{k}{c}": [] for k in kinds for c in ("", "_cpu")}
    for _ in range(repeats):
        for kind, (fn, nbytes) in kinds.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            out[kind].append(nbytes / (time.perf_counter() - t0))
            out[kind + "_cpu"].append(nbytes / max(time.thread_time() - c0, 1e-9))
    med = {k: statistics.median(v) for k, v in out.items()}
    # the limit: the faster of the two reads (whichever of torch's and numpy's loops streams better here)
    return {"read_bytes_per_s": max(med["read_mv"], med["read_sum"]),
            "read_bytes_per_cpu_s": max(med["read_mv_cpu"], med["read_sum_cpu"]),
            "copy_bytes_per_s": med["copy"], "copy_bytes_per_cpu_s": med["copy_cpu"], "each": med,
            "buffer_mib": mib, "repeats": repeats}


def measure(model_dir: Path = SMOLLM2, tokens: int = 512, seconds: float = 1.0, procs: int | None = None) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    procs = procs or os.cpu_count() or 1
    t0 = time.perf_counter()
    one = matmul_rate(config, tokens, seconds)
    with mp.get_context("spawn").Pool(procs) as pool:  # all cores at once, one thread each, as training runs
        each = pool.map(_matmul_child, [(config, tokens, seconds)] * procs)
    return {"model": str(Path(model_dir).relative_to(REPO)) if Path(model_dir).is_relative_to(REPO) else str(model_dir),
            "tokens": tokens, "matmul_1_thread": one,
            "matmul_all_cores": {"processes": procs, "per_process_flops_per_s": [e["mix_flops_per_s"] for e in each],
                                 "flops_per_s": sum(e["mix_flops_per_s"] for e in each),
                                 # per CPU-second of all processes together: the mean of theirs
                                 "flops_per_cpu_s": statistics.mean(e["mix_flops_per_cpu_s"] for e in each)},
            "memory_1_thread": memory_bandwidth(), "seconds": round(time.perf_counter() - t0, 1)}


def describe(lim: dict) -> str:
    return (f"fp32 matmul at the model's shapes: {lim['matmul_1_thread']['mix_flops_per_s'] / 1e9:.1f} GFLOP/s on one "
            f"thread, {lim['matmul_all_cores']['flops_per_s'] / 1e9:.1f} GFLOP/s on {lim['matmul_all_cores']['processes']} "
            f"cores at once; memory (1 thread): read {lim['memory_1_thread']['read_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"copy {lim['memory_1_thread']['copy_bytes_per_s'] / 1e9:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(SMOLLM2))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--out", default=str(RESULTS / "limits.json"))
    a = ap.parse_args()
    lim = measure(Path(a.model), a.tokens, a.seconds)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(lim, indent=1) + "\n")
    print(describe(lim))


if __name__ == "__main__":
    sys.exit(main())
