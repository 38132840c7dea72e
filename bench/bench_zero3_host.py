"""ZeRO-3's host-side work per layer and per gathered module, measured under real DeepSpeed on CPU ranks (issue 53).

    .venv/bin/python bench/bench_zero3_host.py [--modules 4 16 64 256] [--ranks 2 1] [--llama-layers 4 8 16 32]
                                                [--steps 20] [--out PATH]

What a FLOPs-and-bytes time model leaves out: for every module, DeepSpeed's ZeRO-3 runs Python on the host each
pass: its pre/post-forward hooks, the trace and the prefetch bookkeeping (partitioned_param_coordinator.py
fetch_sub_module / release_sub_module), each gather's call, and in backward the gradient hooks and the
reduce-scatter's bucketing. On a GPU that work runs ahead of the kernels and is hidden while they take longer; at
short rows they may not.

1. The figure the planner uses (planner/time.py zero3_host_s_per_layer_pass, _per_lora_layer_pass): HF Llama's own
   module tree (configs/models/tiny_llama31.json at 4-32 layers, vocabulary 1,024, 8 tokens) with gradient
   checkpointing as train/args.py sets it, ZeRO-3 on one rank (no gathers: the hooks alone) minus the plain model;
   the slope over the layers / 3 passes. Full fine-tuning, and LoRA as adapters.py wraps it.
2. How it scales with modules: the same 4,194,304 parameters (fp32) cut into K equal square Linear layers (K = 4,
   16, 64, 256), every parameter gathered (persistence threshold 0, reuse distance 0), ONE token per micro-step so
   compute is ~0 and the bytes moved are the same for every K, at 1 and 2 ranks. Per K: the engine's micro-step,
   minus the same gloo collectives timed alone, minus the plain model's compute; the slope over K is the cost per
   gathered module (per pass: / 2, no recompute here).
Writes bench/results/zero3_host.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_env import REPO, RESULTS  # first: the hub offline, src/ on the path
TOTAL = 1 << 22  # parameters of every model: the bytes moved do not change with K


def worker(spec_path: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    if "layers" in spec:
        return llama_worker(spec)
    k, steps = spec["modules"], spec["steps"]
    d = int((TOTAL // k) ** 0.5)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(k)])

    x = torch.randn(1, d)

    def plain_step(m):  # the compute alone, one process, no DeepSpeed
        m(x).square().mean().backward()

    plain = model()
    for _ in range(3):
        plain_step(plain)
    t0 = time.perf_counter()
    for _ in range(steps):
        plain_step(plain)
    compute = (time.perf_counter() - t0) / steps

    cfg = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())
    zero = {**cfg["zero_optimization"], "stage3_param_persistence_threshold": 0, "reduce_bucket_size": d * d,
            "stage3_prefetch_bucket_size": d * d, "stage3_max_live_parameters": d * d,
            "stage3_max_reuse_distance": 0}
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 10 ** 6,
          "zero_optimization": zero, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "steps_per_print": 10 ** 9,
          "zero_allow_untested_optimizer": True}
    m = model()
    engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=ds)
    for _ in range(3):
        engine.backward(engine(x).square().mean())
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.backward(engine(x).square().mean())
    dist.barrier()
    ds_step = (time.perf_counter() - t0) / steps

    # the same collectives alone: per module, an all-gather in forward and one in backward, a reduce-scatter
    # (one rank: DeepSpeed gathers nothing, partition_parameters.py _no_gather_coalesced; the hooks still run)
    shard = torch.zeros(d * d // world)
    full = torch.zeros(d * d)
    for _ in range(3 if world > 1 else 0):
        dist.all_gather_into_tensor(full, shard)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps if world > 1 else 0):
        for _ in range(k):
            dist.all_gather_into_tensor(full, shard)
            dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(shard, full)
    dist.barrier()
    comm = (time.perf_counter() - t0) / steps
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({"ranks": world, "modules": k, "width": d, "step_s": ds_step, "comm_s": comm,
                                                    "compute_s": compute,
                                                    "host_s": ds_step - comm - compute}))


def llama_worker(spec: dict) -> None:
    """The check on a real module tree: an HF Llama (zerotune's tiny config at `layers` layers, 8 tokens) with
    gradient checkpointing as train/args.py sets it, ZeRO-3 on one rank vs the plain model: host work per
    micro-step, beside passes x modules with parameters x the fitted figure. Its containers, rotary embedding and
    activations run the hooks with nothing to fetch and are not counted as modules."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = AutoConfig.from_pretrained(REPO / "configs" / "models" / "tiny_llama31.json")
    cfg.num_hidden_layers = spec["layers"]
    cfg.vocab_size = 1024  # the layers' work, not a 128K-row head's (the same in both runs, noise in the difference)
    torch.manual_seed(0)

    def model():
        m = AutoModelForCausalLM.from_config(cfg)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.get("lora"):  # zerotune's own wrapping: every linear adapted, each one ZeRO-3 leaf (adapters.py)
            from zerotune.adapters import wrap
            from zerotune.config import load_recipe

            m = wrap(m, load_recipe("tiny", ["peft.method=lora"]))[0]
        return m.train()

    ids = torch.randint(0, cfg.vocab_size, (1, 8))

    def timed(step) -> float:
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(spec["steps"]):
            step()
        return (time.perf_counter() - t0) / spec["steps"]

    plain = model()
    compute = timed(lambda: plain(input_ids=ids, labels=ids).loss.backward())
    m = model()
    gathered = sum(1 for mod in m.modules() if any(True for _ in mod.parameters(recurse=False)))
    params = [p for p in m.parameters() if p.requires_grad]
    cfg_ds = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())
    zero = {**cfg_ds["zero_optimization"], "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 10 ** 6, "zero_optimization": zero,
          "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "steps_per_print": 10 ** 9,
          "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=m, model_parameters=params, config=ds)
    ds_step = timed(lambda: engine.backward(engine(input_ids=ids, labels=ids).loss))
    if dist.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps({"layers": spec["layers"], "lora": bool(spec.get("lora")),
                                                    "modules": gathered, "passes": 3,
                                                    "step_s": ds_step, "compute_s": compute,
                                                    "host_s": ds_step - compute}))


def run(ranks: int, k: int, steps: int, work: Path, layers: int = 0, lora: bool = False) -> dict:
    from zerotune.ports import free_port

    name = f"llama{layers}{'-lora' if lora else ''}" if layers else str(k)
    spec, result = work / f"spec-{ranks}-{name}.json", work / f"result-{ranks}-{name}.json"
    spec.write_text(json.dumps({"modules": k, "steps": steps, "result": str(result),
                                **({"layers": layers, "lora": lora} if layers else {})}))
    # LOCAL_SIZE: without it DeepSpeed's CPU accelerator runs `numactl` for device_count() on every reduce-scatter
    # (cpu_accelerator.py:70-79, ~1 ms each here), a CPU-only cost a CUDA host does not pay
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": str(ranks),
           "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, "--worker", str(spec)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench_zero3_host: {ranks} rank(s), {k} modules failed:\n{proc.stderr[-4000:]}")
    out = json.loads(result.read_text())
    if layers:
        return out
    print(f"bench_zero3_host: {ranks} rank(s), {k:4d} modules of {out['width']}^2: micro-step {out['step_s'] * 1e3:7.2f} ms = "
          f"collectives {out['comm_s'] * 1e3:6.2f} + compute {out['compute_s'] * 1e3:5.2f} + host "
          f"{out['host_s'] * 1e3:7.2f} ms", flush=True)
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return "unknown CPU"


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares host_s = a + b x modules: (b, a)."""
    n = len(rows)
    xs, ys = [r["modules"] for r in rows], [r["host_s"] for r in rows]
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return b, my - b * mx


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 1], help="world sizes (1: no gathers, hooks only)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--llama-layers", type=int, nargs="*", default=[4, 8, 16, 32],
                    help="HF Llama depths for the check on a real module tree (one rank; needs --ranks to include 1)")
    ap.add_argument("--out", type=Path, default=RESULTS / "zero3_host", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "bench"))
    from bench_stats import Steal

    work = REPO / "bench" / "work" / "zero3_host"
    work.mkdir(parents=True, exist_ok=True)
    steal = Steal()
    fits = {}
    rows = []
    for ranks in a.ranks:
        mine = [run(ranks, k, a.steps, work) for k in a.modules]
        per_module, base = fit(mine)
        fits[str(ranks)] = {"host_s_per_module_micro_step": per_module, "host_s_per_module_pass": per_module / 2,
                            "intercept_s": base}
        rows += mine
    # the figure the planner uses, on a real module tree: HF Llama with gradient checkpointing (3 passes), one rank;
    # its slope over the layers is one layer's host work (the model's ends, embedding and head, are the intercept)
    llama = []
    for lora in (False, True):  # full fine-tuning; LoRA as zerotune wraps it (each adapted linear one ZeRO-3 leaf)
        mine = [run(1, 0, a.steps, work, layers, lora) for layers in a.llama_layers]
        if len(mine) < 2:
            continue
        slope, base = fit([{"modules": r["layers"], "host_s": r["host_s"]} for r in mine])
        fits["llama_lora" if lora else "llama"] = {
            "host_s_per_layer_pass": slope / 3, "intercept_s": base,
            "modules_with_parameters_per_layer": (mine[-1]["modules"] - mine[0]["modules"])
            / (mine[-1]["layers"] - mine[0]["layers"])}
        for r in mine:
            print(f"bench_zero3_host: HF Llama{' + LoRA' if lora else ''}, {r['layers']} layers ({r['modules']} modules "
                  f"with parameters), 1 rank: host {r['host_s'] * 1e3:.1f} ms per micro-step", flush=True)
        llama += mine
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "backend": "gloo", "steal": steal.fraction(),
              "fits": fits, "rows": rows, "llama": llama}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["# ZeRO-3's host work per gathered module (DeepSpeed 0.19.8, CPU ranks, gloo)", "",
             f"Measured {result['date']} on {result['cpu']}, CPU steal {result['steal']}; bench/bench_zero3_host.py. "
             "One token per micro-step (compute ~0), the same 4,194,304 parameters cut into K modules, every one "
             "gathered (one rank: DeepSpeed gathers nothing, its hooks still run).", "",
             "| ranks | modules | width | micro-step ms | collectives alone ms | compute ms | host ms |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['ranks']} | {r['modules']} | {r['width']} | {r['step_s'] * 1e3:.2f} | {r['comm_s'] * 1e3:.2f} | "
              f"{r['compute_s'] * 1e3:.2f} | {r['host_s'] * 1e3:.2f} |" for r in rows]
    lines += [""] + [f"Host work per gathered module at {ranks} rank(s): {f['host_s_per_module_micro_step'] * 1e3:.3f} "
                     f"ms per micro-step (forward + backward), {f['host_s_per_module_pass'] * 1e3:.3f} ms per pass "
                     f"(least squares over K; intercept {f['intercept_s'] * 1e3:.2f} ms)." for ranks, f in fits.items()
                     if not ranks.startswith("llama")]
    if llama:
        lines += ["", "The figure the planner uses (planner/time.py zero3_host_s_per_layer_pass), on HF Llama's module "
                  "tree: configs/models/tiny_llama31.json at L layers, vocabulary 1,024, 8 tokens, gradient "
                  "checkpointing as train/args.py sets it (3 passes), ZeRO-3 on one rank minus the plain model; LoRA "
                  "as adapters.py wraps it (r 16 on every linear, each one ZeRO-3 leaf):", "",
                  "| model | layers | modules with parameters | micro-step ms | plain model ms | host ms |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {'LoRA' if r['lora'] else 'full'} | {r['layers']} | {r['modules']} | {r['step_s'] * 1e3:.1f} | "
                  f"{r['compute_s'] * 1e3:.1f} | {r['host_s'] * 1e3:.1f} |" for r in llama]
        for key, what in (("llama", "full fine-tuning"), ("llama_lora", "LoRA")):
            if key in fits:
                f = fits[key]
                per_module = f['host_s_per_layer_pass'] / f['modules_with_parameters_per_layer'] * 1e3
                lines += ["", f"Host work per Llama layer per pass, {what}: {f['host_s_per_layer_pass'] * 1e3:.2f} ms "
                          f"(least squares over L / 3 passes; intercept {f['intercept_s'] * 1e3:.1f} ms)" + (
                              f", {per_module:.3f} ms per module with parameters "
                              f"({f['modules_with_parameters_per_layer']:.0f} per layer; the layer's containers, "
                              "rotary embedding and activation run the hooks too)." if key == "llama" else
                              " (the modules inside each leaf are not hooked: the wrapper gathers base and adapters "
                              "at its entry).")]
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
