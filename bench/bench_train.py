"""Training-throughput benchmark (issue 9): zerotune vs the padded HF Trainer vs TRL SFTTrainer, same job.

    .venv/bin/python bench/bench_train.py      # every config, 2 alternating repeats (LoRA, TRL in the first): ~13 min
    .venv/bin/python bench/bench_train.py --repeats 3 --steps 8 --configs zerotune,trainer_padded

Files: this launcher; train_setup.py (paths, the bench recipe, TRL, the padded data); train_worker.py (the
baselines under torchrun); train_report.py (summaries, ratios, train.md / train.png).

What is compared (one model, one data set, one set of hyper-parameters, all from bench/recipes/bench_train.yaml:
SmolLM2-135M-Instruct, 2 CPU processes under torchrun, DeepSpeed ZeRO-3, fp32, SDPA, AdamW, gradient
checkpointing as the recipe sets it (off); every contender loads the same folder):

- `zerotune`: the real CLI, `python -m zerotune data|train bench/recipes/bench_train.yaml ...`: documents
  truncated to seq_len, packed best-fit-decreasing into seq_len rows (block-causal via restarting position_ids),
  assistant-only labels, micro-batch 1 packed row per rank.
- `trainer_padded`: what a plain transformers user writes: the chat template + one prefix tokenization per
  assistant turn for the labels (bench_data.baseline(), checked equal to prepare's labels there), truncation
  to seq_len, `Trainer` with `DataCollatorForSeq2Seq` (pads each micro-batch to its longest document),
  random sampling (the default; group_by_length is off, as in most scripts).
- `trl_default`: `SFTTrainer` on the raw `messages`, its own tokenization and per-batch padding collator,
  no packing. One non-default: `assistant_only_loss=True`, so that it trains on the same tokens as the others
  (TRL's default trains on every token, prompts included: a different objective at the same compute).
  TRL has no training template for SmolLM2's ChatML: its runs use bench/recipes/chatml_training.jinja; its
  labels are checked equal to zerotune's.
- `trl_packing`: the same with `SFTConfig(packing=True)` (TRL's default "bfd" strategy: best-fit decreasing,
  truncation, padding-free rows flattened per micro-batch with restarting position_ids).
  All TRL runs set bf16=False (SFTConfig defaults to bf16; the others run fp32 on CPU).

Batch sizes: zerotune and trl_packing take 1 packed row of seq_len per rank per micro-step (about
seq_len x packing efficiency real tokens). The padded contenders take `--docs-per-micro` documents per rank
per micro-step, chosen so that their average real tokens per micro-step matches a packed row
(seq_len x efficiency / mean document length, rounded: 2 at seq_len 1024); all use the same gradient
accumulation, so tokens per optimizer step agree within a few percent (both are in the JSON). Each run takes
`--steps` optimizer steps (`--trl-steps` for TRL, whose CPU loss path makes a step 3-4x as long; see the notes).

Measurement: one probe, bench/probe/train_probe.py, installed identically in every contender's workers (the
baselines call it; zerotune's unchanged CLI gets it through bench/probe/sitecustomize.py, on PYTHONPATH for
its runs only). Per micro-batch it counts label tokens (labels != -100: the tokens that carry a loss), real
(non-pad) and processed (input tensor) tokens in `compute_loss`; per optimizer step it takes the wall time
between consecutive step ends (the first step from its start: zerotune's metrics.jsonl definition), the CPU
time of both ranks, and the max RSS over ranks (zerotune's peak-memory definition). The first `--warmup`
steps are dropped. Three estimates of useful-token (label-token) throughput:
- measured: label tokens in the measured steps / their wall time;
- long-run: measured processed tokens / wall time x the padding/packing efficiency on the whole data set x
  its label fraction (the few measured steps see a few dozen documents, whose label fraction and padding vary a
  lot, while the cost per processed token does not; the labels are identical for every contender);
- long-run per CPU-second: the same over the CPU time of the ranks, insensitive to other jobs on the machine.
Configurations alternate (A B C D A B C D ...) so that load from other jobs hits all of them; ratios to the
padded Trainer are taken within each repeat and reported per repeat with their spread. LoRA and TRL run in the
first `--trl-repeats` repeats only (1): no goal is set on them, and twice would not fit make bench's 30 minutes.

TRL is not in requirements.lock: bench/requirements-bench.txt pins it (with its hash) and it is installed
with --no-deps into bench/work/trl-site (gitignored), which only the TRL runs put on PYTHONPATH. So .venv stays
exactly the lock (tests, CI and zerotune never see TRL, and TRL cannot change what the other contenders
import), and no dependency of TRL is resolved anew: its install requirements are checked against .venv here.

Writes bench/results/train.json, train.md and train.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from train_setup import (BENCH, CHAT, CONFIGS, RECIPE, REPO, TRL_SITE, WORK, ZT_OUT, ensure_trl,  # noqa: E402
                         expected_padding_efficiency, procs, recipe, tokenize_padded, trl_label_check, zt_overrides)
from train_report import ab_summary, aggregate, notes, of_matmul_limit, summarise, write  # noqa: E402

from bench_stats import Steal  # noqa: E402
from zerotune import manifest as mf  # noqa: E402
from zerotune.ports import free_port  # noqa: E402


def _run(cmd: list[str], log: Path, env: dict) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if rc != 0:
        sys.exit(f"bench_train: {' '.join(cmd[:6])} ... failed (exit {rc}); see {log}:\n"
                 + "".join(log.read_text().splitlines(True)[-30:]))
    return time.perf_counter() - t0


def _torchrun(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs()}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(BENCH / "train_worker.py"), str(spec_path)]


def run_zerotune(a, log: Path, env: dict, extra: list[str]) -> dict:
    out = WORK / "probe-zerotune.jsonl"
    out.unlink(missing_ok=True)
    env = dict(env, ZT_BENCH_PROBE=str(out),
               PYTHONPATH=os.pathsep.join(p for p in (str(BENCH / "probe"), env.get("PYTHONPATH")) if p))
    wall = _run([sys.executable, "-m", "zerotune", "finetune", str(RECIPE.relative_to(REPO)), *zt_overrides(a), *extra],
                log, env)
    rows = mf.read_jsonl(out)
    own = {r["step"]: r for r in mf.read_jsonl(ZT_OUT / "train" / "metrics.jsonl")}
    for r in rows:  # zerotune's own metrics.jsonl, for comparison with the probe
        r["zerotune_metrics"] = {k: own.get(r["step"], {}).get(k) for k in
                                 ("step_time_s", "label_tokens_per_s", "peak_mem_gib_max_rank")}
    return {"wall_s": wall, "rows": rows}


def run_baseline(kind: str, a, spec: dict, log: Path, env: dict) -> dict:
    spec = {**spec, "kind": kind, "out": str(WORK / f"probe-{kind}.jsonl")}
    Path(spec["out"]).unlink(missing_ok=True)
    spec_path = WORK / f"spec-{kind}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(env, DS_ACCELERATOR="cpu")
    if kind.startswith("trl"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRL_SITE), env.get("PYTHONPATH")) if p)
    wall = _run(_torchrun(spec_path), log, env)
    return {"wall_s": wall, "rows": mf.read_jsonl(Path(spec["out"]))}


def run_ab(a, spec: dict, b: int, long_eff: dict, env: dict) -> dict:
    """The same-job A/B diagnostic (train_worker.ab_worker): packed and padded batches alternating in one job."""
    log, out = WORK / "log-ab.txt", WORK / "probe-ab.json"
    spec_ab = {**spec, "kind": "ab", "micro_batch": b, "steps": a.ab_steps, "out": str(out)}
    (WORK / "spec-ab.json").write_text(json.dumps(spec_ab))
    wall = _run(_torchrun(WORK / "spec-ab.json"), log, dict(env, DS_ACCELERATOR="cpu"))
    ab = {**ab_summary(json.loads(out.read_text()), long_eff), "wall_s": round(wall, 1)}
    print(f"bench_train: same-job A/B: packed {ab['packed']['ms_per_processed_token_wall']:.2f} vs padded "
          f"{ab['padded']['ms_per_processed_token_wall']:.2f} ms per processed token (wall), implied label-token "
          f"ratio {ab['implied_label_token_ratio_wall']:.2f}x wall, {ab['implied_label_token_ratio_cpu']:.2f}x CPU",
          flush=True)
    return ab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    ap.add_argument("--trl-steps", type=int, default=4,
                    help="optimizer steps per TRL run (its CPU loss path makes a step ~3-4x as long)")
    # 2: ZeRO-3 records its parameter trace in step 1 and, in step 2 (the first with a complete trace), fills
    # DeepSpeed's lru_cache of which parameters to release with a scan that is quadratic in the traced modules
    # (+3 CPU-s per rank for full fine-tuning, +29 for LoRA on SmolLM2, once per run: bench/README.md)
    ap.add_argument("--warmup", type=int, default=2, help="first steps not measured")
    ap.add_argument("--ab-steps", type=int, default=0,
                    help="steps of the same-job A/B diagnostic (packed and padded batches alternating); 0 = skip")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats of zerotune and the padded Trainer")
    ap.add_argument("--trl-repeats", type=int, default=1,
                    help="of those, how many also run LoRA and the TRL configs (side contenders: no goal is set on "
                         "them, and the budget of 30 minutes does not fit them twice)")
    ap.add_argument("--docs-per-micro", type=int, default=0, help="padded micro-batch in documents; 0 = match a packed row")
    ap.add_argument("--conversations", type=int, default=0, help="0 = 2x what the longest run consumes")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--limit-seconds", type=float, default=1.0, help="time per shape of the matmul-limit measurement")
    ap.add_argument("--out", default=str(BENCH / "results" / "train"))
    a = ap.parse_args()

    t_all = time.perf_counter()
    configs = [c for c in a.configs.split(",") if c]
    WORK.mkdir(parents=True, exist_ok=True)
    trl_info = ensure_trl() if any(c.startswith("trl") for c in configs) else None
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}

    from bench_data import generate

    from zerotune.config import load_recipe
    from zerotune.train.launch import materialise_base

    # Data: enough conversations for every run (packed rows hold ~seq_len / 474 documents at seq_len 1024).
    n = a.conversations or max(400, int(2 * a.steps * a.grad_accum * procs() * 4))
    generate(CHAT, n)
    t0 = time.perf_counter()
    subprocess.check_call([sys.executable, "-m", "zerotune", "data", str(RECIPE.relative_to(REPO)),
                           *zt_overrides(a), "--skip-preflight"], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    prepare_s = time.perf_counter() - t0
    recipe_ = load_recipe(str(RECIPE), zt_overrides(a))
    base = materialise_base(recipe_)  # the same initial weights for every contender
    manifest = json.loads((ZT_OUT / "data" / "manifest.json").read_text())
    pad = tokenize_padded(a, n, WORK / "padded")
    pack_eff = manifest["packing"]["efficiency"]
    b = a.docs_per_micro or max(1, round(a.seq_len * pack_eff / pad["mean_doc_tokens"]))
    lengths = pad.pop("lengths")
    spec = {"base": str(base), "seq_len": a.seq_len, "grad_accum": a.grad_accum, "steps": a.steps,
            "conversations": n, "tokenized": str(WORK / "padded"), "overrides": zt_overrides(a)}
    label_check = trl_label_check(min(200, n)) if trl_info else None
    # The whole data set's label fraction (label / real tokens: identical labels for every contender) and each
    # contender's real / processed tokens on it: packed rows (zerotune's manifest), padding-free TRL rows (1.0),
    # or random micro-batches of b documents padded to their longest (expected value over shuffles).
    label_fraction = manifest["tokens"]["train_label"] / manifest["tokens"]["train_real"]
    pad_eff = {k: expected_padding_efficiency(lengths, k) for k in (1, 2, 4, 8)}
    pad_eff[b] = expected_padding_efficiency(lengths, b)
    long_eff = {"zerotune": pack_eff, "zerotune_lora": pack_eff, "trainer_padded": pad_eff[b], "trl_default": pad_eff[b],
                "trl_packing": 1.0}
    print(f"bench_train: {n} conversations, seq_len {a.seq_len}, packing efficiency {pack_eff}, padded micro-batch "
          f"{b} documents, grad-accum {a.grad_accum}, {a.steps} steps ({a.warmup} warm-up), {a.repeats} repeats",
          flush=True)

    from bench_limits import describe, measure
    from zerotune.metrics import flops_per_token
    from zerotune.planner.target import model_shape

    limits = measure(base, a.seq_len, seconds=a.limit_seconds)  # this machine's fp32 matmul rate at the model's shapes
    print(f"bench_train: {describe(limits)}", flush=True)
    shape = model_shape(recipe_)
    fpt = flops_per_token(shape.n_params, shape.layers, shape.hidden, a.seq_len)

    repeats = []
    for rep in range(a.repeats):
        this = {}
        for c in configs:
            if (c.startswith("trl") or c == "zerotune_lora") and rep >= a.trl_repeats:
                continue
            steal = Steal()
            log = WORK / f"log-{c}-{rep}.txt"
            if c.startswith("zerotune"):
                run = run_zerotune(a, log, env, ["peft.method=lora"] if c == "zerotune_lora" else [])
            else:
                run = run_baseline(c, a, {**spec, "micro_batch": 1 if c == "trl_packing" else b,
                                          "steps": a.trl_steps if c.startswith("trl") else a.steps}, log, env)
            this[c] = {**summarise(run, a.warmup, long_eff[c], label_fraction), "steal": steal.fraction()}
            this[c].update(of_matmul_limit(this[c], fpt, limits))
            print(f"bench_train: repeat {rep + 1} {c}: {this[c]['label_tokens_per_s']:,.0f} label tok/s, "
                  f"{this[c]['processed_tokens_per_s']:,.0f} processed tok/s, eff {this[c]['efficiency']:.3f}, "
                  f"peak {this[c]['peak_mem_gib']:.2f} GiB, run {this[c]['wall_s']:.0f} s, steal {this[c]['steal']}", flush=True)
        repeats.append(this)

    ab = run_ab(a, spec, b, long_eff, env) if a.ab_steps and {"zerotune", "trainer_padded"} <= set(configs) else None

    median, ratios = aggregate(repeats, configs)
    res = {
        "setup": {"seq_len": a.seq_len, "grad_accum": a.grad_accum, "steps": a.steps, "trl_steps": a.trl_steps,
                  "warmup": a.warmup,
                  "repeats": a.repeats, "trl_repeats": min(a.trl_repeats, a.repeats), "conversations": n, "processes": procs(),
                  "recipe_train_section": dataclasses.asdict(recipe(zt_overrides(a)).train),
                  "padded_docs_per_micro_batch": b, "packing_efficiency_prepared": pack_eff,
                  "label_fraction": label_fraction, "efficiency_long_run": long_eff,
                  "expected_padding_efficiency_by_docs_per_micro_batch": pad_eff,
                  "mean_doc_tokens": pad["mean_doc_tokens"], "padded_data": pad, "zerotune_prepare_s": round(prepare_s, 1),
                  "model": recipe_.model.name_or_path, "deepspeed": recipe_.train.deepspeed,
                  "model_description": f"{Path(recipe_.model.name_or_path).name} ({shape.layers} layers, width "
                                       f"{shape.hidden}, {shape.vocab:,}-token vocabulary, "
                                       f"{shape.n_params / 1e6:.1f}M parameters)",
                  "recipe": str(RECIPE.relative_to(REPO)), "zerotune_overrides": zt_overrides(a)},
        "trl": trl_info, "trl_label_check": label_check, "same_job_ab": ab, "limits": limits,
        "flops_per_token": fpt,
        "median": median, "ratio_vs_trainer_padded": ratios, "repeats": repeats,
        "notes": notes(label_check, b, a.seq_len, pack_eff, pad["mean_doc_tokens"], pad_eff),
        "wall_s": round(time.perf_counter() - t_all, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    print(write(res, Path(a.out)))
    print(f"bench_train: {res['wall_s']:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
