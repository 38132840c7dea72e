"""DeepSpeed's CPU Adam on this host: parameters per second, per thread count (issue 53, the offload path).

    .venv/bin/python bench/bench_cpu_adam.py [--params 50000000] [--steps 5]

ZeRO-Offload's optimizer step is DeepSpeedCPUAdam over each node's fp32 partition (planner/time.py `cpu_adam`,
taken from the ZeRO-Offload tutorial's DGX-2 log: 1.62e9 parameters/s per 48-core node). This measures the same
op here (fp32 parameters, gradients, Adam moments; deepspeed 0.19.8, JIT-built) so the figure can be compared per
core. The PCIe copies and pinned-memory traffic of the offload path need a GPU and are not measured here.
Writes bench/results/cpu_adam.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from bench_env import RESULTS  # first: the hub offline, src/ on the path


def rate(n: int, steps: int, threads: int) -> float:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=1e-3)
    opt.step()  # the moments allocated, the op loaded
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return n * steps / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=50_000_000)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    from zerotune.planner import time as tm

    cores = os.cpu_count() or 1
    rows = [{"threads": t, "params_per_s": rate(a.params, a.steps, t)} for t in sorted({1, cores})]
    figure = tm.F("cpu_adam")
    result = {"date": time.strftime("%Y-%m-%d"), "cores": cores, "params": a.params, "rows": rows,
              "figure_per_node": figure, "figure_cores": 48}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_adam.json").write_text(json.dumps(result, indent=1))
    lines = ["# DeepSpeed's CPU Adam on this host (deepspeed 0.19.8)", "",
             f"Measured {result['date']}, {cores} cores, {a.params:,} fp32 parameters, {a.steps} steps; "
             "bench/bench_cpu_adam.py.", "",
             "| threads | parameters/s | per thread |", "|---:|---:|---:|"]
    lines += [f"| {r['threads']} | {r['params_per_s']:.3g} | {r['params_per_s'] / r['threads']:.3g} |" for r in rows]
    lines += ["", f"The plan's figure (`cpu_adam`, the ZeRO-Offload tutorial's DGX-2 log): {figure:.3g} per 48-core "
              f"node, {figure / 48:.3g} per core."]
    (RESULTS / "cpu_adam.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
