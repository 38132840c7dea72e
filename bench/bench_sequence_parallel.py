"""Sequence parallelism on CPU: the longest packed row that trains under a memory cap, and tokens per CPU-second,
with each row on one rank (SP 1) or shared by three (SP 3), training SmolLM2-135M-Instruct as zerotune trains it.

    .venv/bin/python bench/bench_sequence_parallel.py [--seq 3072 6144 12288] [--out PATH]

Why 3: SmolLM2 has 9 attention heads and 3 KV heads, so DeepSpeed's Ulysses splits it over 1, 3 or 9 ranks (2 is
refused: config.check_sequence_parallel_heads), and rows are multiples of 3 tokens. Both run 3 processes (on this machine's 2 cores: tokens per
CPU-second is the comparable figure, per wall-second is stated beside it), DeepSpeed ZeRO-3 over the 3, fp32,
gradient checkpointing, sdpa_docs, the worker's own TrainingArguments and Trainer (train/args.py,
train/sequence_parallel.py). SP 1: each rank trains its own row (data-parallel 3); SP 3: the three share one row
(data-parallel 1). Rows are packed by zerotune's best-fit-decreasing from bench_data.py's chats (bench_attention.py
packed_row). Per configuration: one warm-up optimizer step, then one timed; per rank the peak RSS (ru_maxrss) and
the CPU seconds of the timed step.

The cap is fixed before measuring, by rule: the largest per-rank peak SP 1 reaches at 3,072-token rows (5.9 GiB
here: three processes, each with the interpreter and libraries, its ZeRO-3 share, and a row's fp32 logits,
log-softmax and their gradient at SmolLM2's 49,152-token vocabulary). The result is the longest row each degree
trains at or under it (rows double from 3,072). SP 1 runs at 3,072 only: three 6K rows at once would need more
RAM than this machine's 24 GB.
Writes bench/results/sequence_parallel.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench_env import REPO, RESULTS, SMOLLM2  # first: the hub offline, src/ on the path

MODEL = SMOLLM2
PROCS = 3
CAP_AT = 3072  # the cap: SP 1's per-rank peak at rows of this many tokens
SP1_MAX = 3072  # SP 1 beyond this would hold three longer rows' logits at once: more than this machine's RAM


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback

    from bench_attention import chat_lengths_and_ids, packed_row
    from zerotune import attention, hardware
    from zerotune import batch as batchmod
    from zerotune.config import load_recipe
    from zerotune.quiet import silence_known_noise
    from zerotune.train.args import collate_packed, training_arguments
    from zerotune.train.sequence_parallel import SequenceParallelTrainer

    silence_known_noise()
    spec = json.loads(Path(spec_path).read_text())
    seq, sp = spec["seq"], spec["sp"]
    r = load_recipe("smollm2", [f"data.seq_len={seq}", f"train.sequence_parallel={sp}", "train.micro_batch_size=1",
                                f"train.global_batch_tokens={seq * PROCS // sp}", f"train.cpu_procs={PROCS}",
                                "plan.gpus_per_node=3", "train.save_steps=0", "train.logging_steps=1",
                                f"output_dir={spec['out']}"])
    bp = batchmod.of_recipe(r, PROCS)
    choice = hardware.choose(hardware.detect(), "fp32", "sdpa_docs", "off")
    args = training_arguments(r, bp, choice, False, 2)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    docs = chat_lengths_and_ids(tok, 600 * max(1, seq // 3072), seed=0)
    row, _, _ = packed_row(docs, seq, tok.pad_token_id)
    one = {k: v[0].tolist() for k, v in row.items()}
    train = Dataset.from_list([one] * (2 * PROCS))  # the same typical row for every rank and step
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32,
                                                 attn_implementation=attention.load_name("sdpa_docs"))
    model.config.use_cache = False
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            times.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, a, state, control, **kw):
            w, c = times.pop()
            times.append((time.perf_counter() - w, time.process_time() - c))

    cls = SequenceParallelTrainer if sp > 1 else Trainer
    trainer = cls(model=model, args=args, train_dataset=train, data_collator=collate_packed, callbacks=[Clock()])
    trainer.train()
    wall, cpu = times[-1]  # the second step: the first pays for lazy initialisation
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, {"wall_s": wall, "cpu_s": cpu, "peak_bytes": peak})
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({"seq": seq, "sp": sp, "ranks": got,
                                                    "tokens_per_step": seq * PROCS // sp,
                                                    "loss": trainer.state.log_history[-1].get("train_loss")}))


def run(seq: int, sp: int, work: Path) -> dict:
    from zerotune.ports import free_port

    spec = work / f"spec-{seq}-{sp}.json"
    result = work / f"result-{seq}-{sp}.json"
    spec.write_text(json.dumps({"seq": seq, "sp": sp, "out": str(work / f"run-{seq}-{sp}"), "result": str(result)}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCS}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, "--worker", str(spec)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"bench_sequence_parallel: seq {seq} SP {sp} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(result.read_text())
    ranks = out["ranks"]
    out.update(peak_bytes=max(x["peak_bytes"] for x in ranks), cpu_s=sum(x["cpu_s"] for x in ranks),
               wall_s=max(x["wall_s"] for x in ranks), elapsed_s=round(time.time() - t0, 1))
    out["tokens_per_cpu_s"] = out["tokens_per_step"] / out["cpu_s"]
    out["tokens_per_wall_s"] = out["tokens_per_step"] / out["wall_s"]
    print(f"bench_sequence_parallel: seq {seq:,} SP {sp}: peak {out['peak_bytes'] / 2**30:.2f} GiB per rank, "
          f"{out['tokens_per_cpu_s']:.1f} tokens per CPU-second, {out['tokens_per_wall_s']:.1f} per wall-second",
          flush=True)
    return out


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[3072, 6144, 12288])
    ap.add_argument("--out", type=Path, default=RESULTS / "sequence_parallel", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    from bench_stats import Steal

    work = REPO / "bench" / "work" / "sequence_parallel"
    work.mkdir(parents=True, exist_ok=True)
    steal = Steal()
    rows = [run(seq, sp, work) for seq in a.seq for sp in (1, 3) if sp == 3 or seq <= SP1_MAX]
    cap = max(r["peak_bytes"] for r in rows if r["sp"] == 1 and r["seq"] == CAP_AT)
    longest = {sp: max((r["seq"] for r in rows if r["sp"] == sp and r["peak_bytes"] <= cap), default=None)
               for sp in (1, 3)}
    same = [(x, y) for x in rows for y in rows if x["sp"] == 1 and y["sp"] == 3 and x["seq"] == y["seq"]]
    result = {"date": time.strftime("%Y-%m-%d"), "procs": PROCS, "cap_bytes": cap, "cap_rule": f"SP 1's per-rank "
              f"peak at {CAP_AT}-token rows", "longest_under_cap": longest, "rows": rows, "steal": steal.fraction(),
              "cpu_ratio_sp3_over_sp1": {x["seq"]: round(y["tokens_per_cpu_s"] / x["tokens_per_cpu_s"], 3)
                                         for x, y in same}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# Sequence parallelism on CPU (SmolLM2-135M-Instruct, {PROCS} processes, ZeRO-3, fp32, sdpa_docs)", "",
             f"Measured {result['date']}, CPU steal {result['steal']}. bench/bench_sequence_parallel.py: one warm-up "
             "step, then one timed; peak RSS per rank (ru_maxrss).", "",
             f"Cap: {cap / 2**30:.2f} GiB per rank ({result['cap_rule']}). Longest row under it: SP 1 "
             f"{longest[1]:,} tokens, SP 3 {longest[3]:,} tokens (rows double from {a.seq[0]:,}).", "",
             "| seq_len | SP | peak per rank GiB | tokens per step | tokens / CPU-s | tokens / wall-s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seq']:,} | {r['sp']} | {r['peak_bytes'] / 2**30:.2f} | {r['tokens_per_step']:,} | "
                     f"{r['tokens_per_cpu_s']:.1f} | {r['tokens_per_wall_s']:.1f} |")
    lines += ["", "SP 3 / SP 1 tokens per CPU-second at the same row: "
              + ", ".join(f"{s:,}: {v:.2f}x" for s, v in result["cpu_ratio_sp3_over_sp1"].items())]
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
