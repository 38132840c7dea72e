"""Training-throughput benchmark (issue 9): zerotune vs the padded HF Trainer vs TRL SFTTrainer, same job.

    .venv/bin/python bench/bench_train.py      # zerotune + padded Trainer x 3 alternating repeats, TRL x 1: 10-13 min
    .venv/bin/python bench/bench_train.py --repeats 3 --steps 8 --configs zerotune,trainer_padded

What is compared (one model, one data set, one set of hyper-parameters, 2 CPU processes under torchrun,
DeepSpeed ZeRO-3 from configs/deepspeed/zero3.json, fp32, SDPA, gradient checkpointing, AdamW, lr 1e-4
cosine with 10% warm-up, seed 42; the model is the tiny Llama-3.1 of configs/models/tiny_llama31.json,
initialised once by zerotune with seed 1234 and loaded from that folder by every contender):

- `zerotune`: the real CLI, `python -m zerotune prepare|train bench/recipes/bench_train.yaml ...`: documents
  truncated to seq_len, packed best-fit-decreasing into seq_len rows (block-causal via restarting position_ids),
  assistant-only labels, micro-batch 1 packed row per rank.
- `trainer_padded`: what a plain transformers user writes: the chat template + one prefix tokenization per
  assistant turn for the labels (bench_data.baseline(), checked equal to prepare's labels there), truncation
  to seq_len, `Trainer` with `DataCollatorForSeq2Seq` (pads each micro-batch to its longest document),
  random sampling (the default; group_by_length is off, as in most scripts).
- `trl_default`: `SFTTrainer` on the raw `messages`, its own tokenization and per-batch padding collator,
  no packing. One non-default: `assistant_only_loss=True`, so that it trains on the same tokens as the others
  (TRL's default trains on every token, prompts included: a different objective at the same compute).
  TRL swaps in its llama3 training template for the masks; its labels are checked equal to zerotune's.
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
padded Trainer are taken within each repeat and reported per repeat with their spread.

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
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
WORK = BENCH / "work" / "train"
TRL_SITE = BENCH / "work" / "trl-site"
RECIPE = BENCH / "recipes" / "bench_train.yaml"  # model, data and every hyper-parameter of every contender
CHATML_TRAINING = BENCH / "recipes" / "chatml_training.jinja"  # TRL's assistant-only masks for SmolLM2's ChatML
CHAT = WORK / "chat.jsonl"  # the path bench/recipes/bench_train.yaml reads
ZT_OUT = WORK / "zerotune"
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(BENCH))

from bench_stats import Steal, pct, ratio_stats  # noqa: E402
from zerotune import manifest as mf  # noqa: E402

# The three estimates of useful-token throughput whose ratios to the padded Trainer are reported
METRICS = {"label_tokens_per_s": "measured", "label_tokens_per_s_long_run": "long-run",
           "label_tokens_per_cpu_s_long_run": "long-run, per CPU-s"}
CONFIGS = ("zerotune", "zerotune_lora", "trainer_padded", "trl_default", "trl_packing")
LABELS = {"zerotune": "zerotune (packed, CLI)", "zerotune_lora": "zerotune LoRA r16 (packed, CLI)",
          "trainer_padded": "transformers Trainer, padded per batch",
          "trl_default": "TRL SFTTrainer, default (padded)", "trl_packing": "TRL SFTTrainer, packing=True"}
# Hyper-parameters shared by every contender (the bench recipe states the same values for zerotune).


# ---------------------------------------------------------------------------------------------------------------
# TRL: installed for the benchmark only, into bench/work/trl-site (not into .venv)

def trl_requirement() -> str:
    for line in (BENCH / "requirements-bench.txt").read_text().splitlines():
        if line.strip().startswith("trl=="):
            return line.split()[0]
    raise RuntimeError("bench/requirements-bench.txt pins no trl version")


def ensure_trl() -> dict:
    """Install the pinned TRL into bench/work/trl-site if missing; check its install requirements against .venv."""
    from importlib import metadata

    from packaging.requirements import Requirement

    want = trl_requirement().split("==")[1]
    if not (TRL_SITE / f"trl-{want}.dist-info").exists():
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade",
                               "--target", str(TRL_SITE), "-r", str(BENCH / "requirements-bench.txt")])
    dist = next(metadata.distributions(path=[str(TRL_SITE)], name="trl"))
    checks = []
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        checks.append({"requirement": spec, "installed": have,
                       "ok": have is not None and req.specifier.contains(have, prereleases=True)})
    bad = [c for c in checks if not c["ok"]]
    if bad:
        raise RuntimeError(f"trl {dist.version} needs packages .venv does not satisfy: {bad}")
    return {"version": dist.version, "installed_to": str(TRL_SITE.relative_to(REPO)),
            "install": "pip install --no-deps --target bench/work/trl-site -r bench/requirements-bench.txt",
            "requirements_checked": checks}


# ---------------------------------------------------------------------------------------------------------------
# Worker side (under torchrun): the baselines

def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from zerotune import batch as batchmod
    from zerotune import hardware
    from zerotune.data.prepare import load_tokenizer
    from zerotune.train import training_kwargs

    spec = json.loads(Path(spec_path).read_text())
    kind = spec["kind"]
    r = recipe(spec["overrides"])
    bp = batchmod.derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, r.train.cpu_procs)
    choice = hardware.choose(hardware.detect(), r.train.precision, r.train.attention, r.train.liger)
    # zerotune's own TrainingArguments fields; what differs is only what makes each contender what it is: its
    # micro-batch (documents, not packed rows), a plain user's defaults (random sampling, unused columns
    # dropped), and no checkpoints
    common = {**training_kwargs(r, bp, choice, False, spec["steps"]), "output_dir": str(WORK / f"ckpt-{kind}"),
              "per_device_train_batch_size": spec["micro_batch"], "save_strategy": "no", "report_to": [],
              "remove_unused_columns": True, "train_sampling_strategy": "random"}
    if kind == "ab":
        common.update(per_device_train_batch_size=1, gradient_accumulation_steps=1,
                      remove_unused_columns=False, train_sampling_strategy="sequential")
    if kind in ("trainer_padded", "ab"):
        args = TrainingArguments(**common)  # before the model: ZeRO-3 shards at load time
    else:
        from trl import SFTConfig
        args = SFTConfig(**common, max_length=spec["seq_len"], packing=kind == "trl_packing",
                         assistant_only_loss=True, chat_template_path=trl_chat_template())
        # (bf16 comes from training_kwargs, as for zerotune: SFTConfig's own default would be bf16 on)
    import deepspeed
    # As in zerotune (and NOTES.md): under use_cpu=True the Trainer does not set up deepspeed.comm, so
    # zero.Init would see world size 1 and reject the batch config.
    deepspeed.init_distributed(dist_backend="gloo")
    tok = load_tokenizer(r)  # the same tokenizer and pad id as zerotune (padding is label-masked either way)
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False

    sys.path.insert(0, str(BENCH / "probe"))
    from train_probe import install

    install(spec["out"])  # the same probe zerotune's workers get through bench/probe/sitecustomize.py

    if kind == "ab":
        return ab_worker(spec, args, model, tok)
    if kind == "trainer_padded":
        ds = load_from_disk(spec["tokenized"])

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          data_collator=DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100))
    else:
        from trl import SFTTrainer

        with open(CHAT) as f:
            ds = Dataset.from_list([json.loads(x) for _, x in zip(range(spec["conversations"]), f)])
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    dist.barrier()


def ab_worker(spec: dict, args, model, tok) -> None:
    """Diagnostic, not a contender: ONE DeepSpeed job whose optimizer steps alternate between zerotune's packed
    rows (one per rank) and the padded Trainer's micro-batches (2 documents per rank), so load from other jobs hits
    both alike. Gives the wall and CPU time per processed token of each batch shape under ZeRO-3."""
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from transformers import Trainer, TrainerCallback

    packed, padded = load_from_disk(str(ZT_OUT / "data" / "train")), load_from_disk(spec["tokenized"])
    b, pad_id = spec["micro_batch"], tok.pad_token_id

    def pk(i):
        return {k: torch.tensor([packed[i][k]]) for k in ("input_ids", "labels", "position_ids")}

    def pd(i):
        rows = [padded[b * i + k] for k in range(b)]
        n = max(len(r["input_ids"]) for r in rows)
        return {"input_ids": torch.tensor([r["input_ids"] + [pad_id] * (n - len(r["input_ids"])) for r in rows]),
                "labels": torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows]),
                "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"]))
                                                for r in rows])}

    # items 2j and 2j+1 go to ranks 0 and 1 at step j: both ranks see the same shape in a step
    items = [pk(2 * j + r) if j % 2 == 0 else pd(2 * j + r) for j in range(args.max_steps) for r in range(2)]
    log, tokens = [], []

    class Steps(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, a, state, control, **kw):
            log.append((time.perf_counter() - self.t0, time.process_time() - self.c0, tokens[-1]))

    class T(Trainer):
        def compute_loss(self, model, inputs, *a, **kw):
            tokens.append(inputs["input_ids"].numel())
            return super().compute_loss(model, inputs, *a, **kw)

    T(model=model, args=args, train_dataset=items, data_collator=lambda rows: rows[0], callbacks=[Steps()]).train()
    out = {"packed": [], "padded": []}
    for j, (dt, dcpu, n) in enumerate(log):
        s = torch.tensor([float(n), dcpu])
        dist.all_reduce(s)
        if j >= 2:  # one warm-up step of each shape
            out["packed" if j % 2 == 0 else "padded"].append(
                {"step_time_s": dt, "cpu_s": float(s[1]), "processed_tokens": int(s[0])})
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(out))


def ab_summary(raw: dict, long_eff: dict) -> dict:
    res = {}
    for shape, rows in raw.items():
        res[shape] = {"steps": len(rows),
                      "ms_per_processed_token_wall": statistics.median(1e3 * r["step_time_s"] / r["processed_tokens"]
                                                                      for r in rows),
                      "ms_per_processed_token_cpu": statistics.median(1e3 * r["cpu_s"] / r["processed_tokens"]
                                                                     for r in rows),
                      "rows": rows}
    p, q = res["packed"], res["padded"]
    scale = long_eff["zerotune"] / long_eff["trainer_padded"]
    res["implied_label_token_ratio_wall"] = scale * q["ms_per_processed_token_wall"] / p["ms_per_processed_token_wall"]
    res["implied_label_token_ratio_cpu"] = scale * q["ms_per_processed_token_cpu"] / p["ms_per_processed_token_cpu"]
    return res


# ---------------------------------------------------------------------------------------------------------------
# Launcher side

def recipe(overrides: list[str]):
    from zerotune.config import load_recipe

    return load_recipe(str(RECIPE), overrides)


def procs() -> int:
    return recipe([]).train.cpu_procs


def trl_chat_template() -> str | None:
    """TRL's own training template where it has one for the model's template (Llama-3), else ours (ChatML)."""
    from trl.chat_template_utils import get_training_chat_template

    from zerotune.data.prepare import load_tokenizer

    try:
        get_training_chat_template(load_tokenizer(recipe([])))
        return None  # TRL swaps in its own (Llama-3), or the template has the markers already
    except ValueError:  # TRL: "patching is not supported for this template. Please manually modify [it]"
        return str(CHATML_TRAINING)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], log: Path, env: dict) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if rc != 0:
        sys.exit(f"bench_train: {' '.join(cmd[:6])} ... failed (exit {rc}); see {log}:\n"
                 + "".join(log.read_text().splitlines(True)[-30:]))
    return time.perf_counter() - t0


def zt_overrides(a) -> list[str]:
    return [f"output_dir={ZT_OUT.relative_to(REPO)}", f"data.seq_len={a.seq_len}",
            f"train.max_steps={a.steps}", f"train.global_batch_tokens={a.seq_len * procs() * a.grad_accum}"]


def run_zerotune(a, log: Path, env: dict, extra: list[str]) -> dict:
    out = WORK / "probe-zerotune.jsonl"
    out.unlink(missing_ok=True)
    env = dict(env, ZT_BENCH_PROBE=str(out),
               PYTHONPATH=os.pathsep.join(p for p in (str(BENCH / "probe"), env.get("PYTHONPATH")) if p))
    wall = _run([sys.executable, "-m", "zerotune", "train", str(RECIPE.relative_to(REPO)), *zt_overrides(a), *extra],
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
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs()}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(Path(__file__).resolve()),
           "--worker", str(spec_path)]
    wall = _run(cmd, log, env)
    return {"wall_s": wall, "rows": mf.read_jsonl(Path(spec["out"]))}


def summarise(run: dict, warmup: int, long_run_eff: float, label_fraction: float) -> dict:
    rows = run["rows"]
    m = [r for r in rows if r["step"] > warmup]
    t, cpu = sum(r["step_time_s"] for r in m), sum(r["cpu_s"] for r in m)
    tot = {k: sum(r[k] for r in m) for k in ("label_tokens", "real_tokens", "processed_tokens")}
    return {"measured_steps": len(m), "measured_s": round(t, 2), "measured_cpu_s": round(cpu, 2),
            "wall_s": round(run["wall_s"], 1),
            "startup_and_teardown_s": round(run["wall_s"] - sum(r["step_time_s"] for r in rows), 1),
            "label_tokens_per_s": tot["label_tokens"] / t, "real_tokens_per_s": tot["real_tokens"] / t,
            "processed_tokens_per_s": tot["processed_tokens"] / t,
            # the measured cost per processed token, applied to the whole data set's efficiency and label fraction
            "label_tokens_per_s_long_run": tot["processed_tokens"] / t * long_run_eff * label_fraction,
            "label_tokens_per_cpu_s_long_run": tot["processed_tokens"] / cpu * long_run_eff * label_fraction,
            "cpu_utilisation": cpu / t,  # CPU-seconds of all ranks per second: 2.0 = both cores busy throughout
            "efficiency": tot["real_tokens"] / tot["processed_tokens"], "efficiency_long_run": long_run_eff,
            "label_tokens_per_step": tot["label_tokens"] / len(m), "real_tokens_per_step": tot["real_tokens"] / len(m),
            "peak_mem_gib": max(r["peak_mem_gib_max_rank"] for r in rows), "steps": rows}


def of_matmul_limit(m: dict, flops_tok: float, limits: dict) -> dict:
    """Model FLOPs/s (6N + attention per processed token, padding included: what the contender computes) over
    the fp32 matmul rate of all cores at the model's shapes, per wall- and per CPU-second. With gradient
    checkpointing the forward runs twice: hardware FLOPs are 8N, i.e. x(8/6) on the dense part."""
    flops_s = m["processed_tokens_per_s"] * flops_tok
    flops_cpu_s = m["processed_tokens_per_s"] * flops_tok / m["cpu_utilisation"]
    mm = limits["matmul_all_cores"]
    return {"model_flops_per_s": flops_s, "of_matmul_limit": flops_s / mm["flops_per_s"],
            # per CPU-second of the ranks vs per CPU-second of the microbenchmark: load-independent
            "of_matmul_limit_cpu_s": flops_cpu_s / mm["flops_per_cpu_s"]}


def tokenize_padded(a, n: int, path: Path) -> dict:
    """The plain user's data: chat template, per-turn prefix labels (bench_data.baseline), truncate to seq_len."""
    import numpy as np
    from datasets import Dataset

    from bench_data import baseline
    from zerotune.data.prepare import load_tokenizer

    tok = load_tokenizer(recipe(zt_overrides(a)))
    with open(CHAT) as f:
        convs = [json.loads(x)["messages"] for _, x in zip(range(n), f)]
    docs, secs = baseline(tok, convs)
    ids, labels, dropped = [], [], 0
    for i, l in docs:
        i, l = i[: a.seq_len], l[: a.seq_len]
        if all(x == -100 for x in l):
            dropped += 1  # no label left after truncation: 0/0 loss (zerotune drops these too)
            continue
        ids.append(i)
        labels.append(l)
    Dataset.from_dict({"input_ids": ids, "labels": labels}).save_to_disk(str(path))
    lengths = np.array([len(x) for x in ids])
    return {"documents": len(ids), "dropped_no_labels": dropped, "tokenize_s": round(secs, 1),
            "mean_doc_tokens": float(lengths.mean()), "lengths": lengths,
            "label_fraction": sum(sum(x != -100 for x in l) for l in labels) / int(lengths.sum())}


def expected_padding_efficiency(lengths, b: int, seed: int = 0) -> float:
    """Real / padded tokens of random micro-batches of b documents padded to their longest."""
    import numpy as np

    rng = np.random.default_rng(seed)
    effs = []
    for _ in range(20):
        idx = rng.permutation(len(lengths))[: len(lengths) // b * b].reshape(-1, b)
        effs.append(lengths[idx].sum() / (lengths[idx].max(1).sum() * b))
    return float(np.mean(effs))


def trl_label_check(n: int) -> dict:
    """TRL's assistant masks (with the training template its runs use) vs zerotune's labels, first n conversations."""
    sys.path.insert(0, str(TRL_SITE))
    from trl.chat_template_utils import get_training_chat_template

    from bench_data import baseline
    from zerotune.data.prepare import load_tokenizer

    tok = load_tokenizer(recipe([]))
    path = trl_chat_template()
    tmpl = Path(path).read_text() if path else get_training_chat_template(tok) or tok.chat_template
    with open(CHAT) as f:
        convs = [json.loads(x)["messages"] for _, x in zip(range(n), f)]
    same = 0
    for m, (ids, lab) in zip(convs, baseline(tok, convs)[0]):
        o = tok.apply_chat_template(m, chat_template=tmpl, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        same += list(o["input_ids"]) == ids and [i if k else -100 for i, k in zip(o["input_ids"], o["assistant_masks"])] == lab
    return {"conversations": n, "identical_ids_and_labels": same}


def plot(res: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c for c in CONFIGS if c in res["median"]]
    colors = ["#228833" if c == "zerotune" else "#4477aa" if c == "trainer_padded" else "#ccbb44" for c in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = list(range(len(names)))
    w = 0.4
    a.bar([i - w / 2 for i in x], [res["median"][c]["label_tokens_per_s"] for c in names], w, color=colors,
          label="measured steps")
    a.bar([i + w / 2 for i in x], [res["median"][c]["label_tokens_per_s_long_run"] for c in names], w,
          color=colors, alpha=0.5, hatch="//", label="long-run estimate")
    for i, c in enumerate(names):
        mine = [r[c] for r in res["repeats"] if c in r]
        a.scatter([i - w / 2] * len(mine), [m["label_tokens_per_s"] for m in mine],
                  color="k", s=10, zorder=3)
        a.scatter([i + w / 2] * len(mine), [m["label_tokens_per_s_long_run"] for m in mine],
                  color="k", s=10, zorder=3)
    a.set_ylabel("label tokens / s (2 CPU ranks)")
    a.set_title("Useful-token throughput (median; dots = repeats)", fontsize=10)
    a.legend(fontsize=8)
    b.bar(x, [res["median"][c]["peak_mem_gib"] for c in names], color=colors)
    b.set_ylabel("peak RSS, max over ranks (GiB)")
    b.set_title("Peak memory", fontsize=10)
    for ax in (a, b):
        ax.set_xticks(x, [LABELS[c].replace(", ", ",\n") for c in names], fontsize=8)
    st = res["setup"]
    fig.suptitle(f"{st['model']}, seq_len {st['seq_len']}, DeepSpeed ZeRO-3 on {procs()} CPU processes, "
                 f"{st['repeats']} alternating repeats", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def markdown(res: dict) -> str:
    s, med, rat = res["setup"], res["median"], res["ratio_vs_trainer_padded"]
    lines = [
        "# Training-throughput benchmark (`bench/bench_train.py`)",
        "",
        f"{s['model_description']}, "
        f"{s['conversations']:,} synthetic multi-turn chats (bench_data.generate; mean {s['mean_doc_tokens']:.0f} "
        f"tokens after truncation to seq_len {s['seq_len']}, {s['label_fraction']:.1%} of them label tokens), "
        f"DeepSpeed ZeRO-3 on {procs()} CPU processes, fp32, gradient accumulation {s['grad_accum']}, "
        f"{s['steps']} optimizer steps per run ({s['trl_steps']} for TRL) of which the first {s['warmup']} not "
        f"measured, {s['repeats']} "
        f"alternating repeats (TRL in the first {s.get('trl_repeats', s['repeats'])}), {res['machine']['cpus']} CPUs shared with other jobs (ratios within a repeat are what "
        f"count). Whole benchmark: {res['wall_s'] / 60:.1f} min. Medians over repeats:",
        "",
        "| config | label tokens/s, measured | label tokens/s, long-run | label tokens per CPU-s, long-run | "
        "total tokens processed/s | padding/packing efficiency, measured (data set) | peak memory (GiB) | "
        "ratio vs padded Trainer: measured / long-run / per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in CONFIGS:
        if c not in med:
            continue
        m = med[c]
        r = [rat.get(k, {}).get(c, {}).get("median", 1.0) for k in METRICS]
        lines.append(f"| {LABELS[c]} | {m['label_tokens_per_s']:,.0f} | {m['label_tokens_per_s_long_run']:,.0f} | "
                     f"{m['label_tokens_per_cpu_s_long_run']:,.0f} | {m['processed_tokens_per_s']:,.0f} | "
                     f"{m['efficiency']:.3f} ({m['efficiency_long_run']:.3f}) | {m['peak_mem_gib']:.2f} | "
                     + " / ".join(f"{x:.2f}x" for x in r) + " |")
    lines += ["", "- *measured*: label tokens counted in the measured steps / their wall time.",
              "- *long-run*: the measured processed tokens/s x the padding/packing efficiency on the whole data set x "
              "its label fraction. The measured steps see only a few dozen documents, whose label fraction and "
              "padding vary a lot; the cost per processed token does not. With identical labels for every contender, "
              "this is the label-token rate of a long run without that sample noise.",
              "- *per CPU-s*: the same with the CPU time of the worker processes (user + system, both ranks) instead "
              "of wall time: insensitive to other jobs taking the cores. On an idle machine it is the wall rate / "
              f"{procs()}.",
              "", "Ratio to the padded Trainer in each repeat (spread = (max - min) / median):", "",
              "| config | metric | " + " | ".join(f"repeat {i + 1}" for i in range(s["repeats"])) + " | spread |",
              "|---|---|" + "---:|" * (s["repeats"] + 1)]
    for key, name in METRICS.items():
        for c, r in rat.get(key, {}).items():
            cells = r["per_repeat"] + [None] * (s["repeats"] - len(r["per_repeat"]))
            lines.append(f"| {LABELS[c]} | {name} | " + " | ".join("-" if x is None else f"{x:.2f}x" for x in cells) +
                         (f" | {r['spread']:.1%} |" if len(r["per_repeat"]) > 1 else " | - |"))
    lines += ["", "CPU-seconds the job got per wall second (2.00 = both cores throughout; less = other jobs took them): "
              + "; ".join(f"{LABELS[c]} " + ", ".join(f"{r[c]['cpu_utilisation']:.2f}" for r in res["repeats"] if c in r)
                          for c in CONFIGS if c in med) + ".",
              "", "CPU steal during each run (share of the vCPUs' time the hypervisor gave to other guests, "
              "from /proc/stat; it slows a run without showing in its CPU time): "
              + "; ".join(f"{LABELS[c]} " + ", ".join(pct(r[c].get("steal")) for r in res["repeats"] if c in r)
                          for c in CONFIGS if c in med) + "."]
    ab = res.get("same_job_ab")
    if ab:
        p, q = ab["packed"], ab["padded"]
        lines += ["", f"Same-job A/B (a diagnostic, not the CLI): one DeepSpeed ZeRO-3 job on the same 2 processes "
                      f"whose optimizer steps alternate between zerotune's packed rows and the padded Trainer's "
                      f"{s['padded_docs_per_micro_batch']}-document micro-batches ({p['steps']} + {q['steps']} measured "
                      f"steps), so that load from other jobs hits both alike. Median per step, ms per processed token: "
                      f"packed {p['ms_per_processed_token_wall']:.2f} wall / {p['ms_per_processed_token_cpu']:.2f} CPU, "
                      f"padded {q['ms_per_processed_token_wall']:.2f} wall / {q['ms_per_processed_token_cpu']:.2f} CPU "
                      f"(padded wall time also includes the rank that waits for the one with the longer batch). "
                      f"With the data set's efficiencies ({s['efficiency_long_run']['zerotune']:.3f} packed, "
                      f"{s['efficiency_long_run']['trainer_padded']:.3f} padded) that implies a useful-token ratio of "
                      f"**{ab['implied_label_token_ratio_wall']:.2f}x** (wall) / "
                      f"{ab['implied_label_token_ratio_cpu']:.2f}x (CPU) for zerotune's batches over the padded ones."]
    lim = res["limits"]["matmul_all_cores"]
    lines += ["", f"Against this machine's limit, measured in the same run: fp32 matmul at the model's shapes, "
                  f"{lim['processes']} single-thread processes at once: {lim['flops_per_s'] / 1e9:.1f} GFLOP/s "
                  f"({lim['flops_per_cpu_s'] / 1e9:.1f} GFLOP per CPU-second of one process). Model FLOPs per "
                  f"processed token: {res['flops_per_token'] / 1e6:.0f} M.", "",
              "| config | model GFLOP/s | of the matmul limit (wall) | of the matmul limit (per CPU-s) |",
              "|---|---:|---:|---:|"]
    lines += [f"| {LABELS[c]} | {med[c]['model_flops_per_s'] / 1e9:.1f} | {med[c]['of_matmul_limit']:.0%} | "
              f"{med[c]['of_matmul_limit_cpu_s']:.0%} |" for c in CONFIGS if c in med]
    goals = []
    z = rat.get("label_tokens_per_cpu_s_long_run", {}).get("zerotune")
    if z:
        goals.append(f"zerotune >= 1.5x the padded Trainer per CPU-second: {z['median']:.2f}x "
                     f"({'met' if z['median'] >= 1.5 else 'NOT met'})")
    if "trl_packing" in med and "zerotune" in med:
        k = "label_tokens_per_cpu_s_long_run"
        both = [r["zerotune"][k] / r["trl_packing"][k] for r in res["repeats"] if "trl_packing" in r]
        x = statistics.median(both)
        goals.append(f"zerotune >= 1.0x TRL with packing per CPU-second: {x:.2f}x ({'met' if x >= 1.0 else 'NOT met'})")
    if "zerotune" in med:
        f = med["zerotune"]["of_matmul_limit_cpu_s"]
        goals.append(f"training at >= 50% of the measured matmul rate (per CPU-second): {f:.0%} "
                     f"({'met' if f >= 0.5 else 'NOT met'})")
    if goals:
        lines += ["", "Issue 21 goals: " + "; ".join(goals) + "."]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    ap.add_argument("--trl-steps", type=int, default=3,
                    help="optimizer steps per TRL run (its CPU loss path makes a step ~3-4x as long)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps not measured")
    ap.add_argument("--ab-steps", type=int, default=0,
                    help="steps of the same-job A/B diagnostic (packed and padded batches alternating); 0 = skip")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats of zerotune and the padded Trainer")
    ap.add_argument("--trl-repeats", type=int, default=1,
                    help="of those, how many also run the TRL configs (CPU artefacts, 3-4x as slow: see the notes)")
    ap.add_argument("--docs-per-micro", type=int, default=0, help="padded micro-batch in documents; 0 = match a packed row")
    ap.add_argument("--conversations", type=int, default=0, help="0 = 2x what the longest run consumes")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--limit-seconds", type=float, default=1.0, help="time per shape of the matmul-limit measurement")
    ap.add_argument("--out", default=str(BENCH / "results" / "train"))
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)

    t_all = time.perf_counter()
    configs = [c for c in a.configs.split(",") if c]
    WORK.mkdir(parents=True, exist_ok=True)
    trl_info = ensure_trl() if any(c.startswith("trl") for c in configs) else None
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}

    from bench_data import generate

    from zerotune.config import load_recipe
    from zerotune.train import materialise_base

    # Data: enough conversations for every run (packed rows hold ~seq_len / 474 documents at seq_len 1024).
    n = a.conversations or max(400, int(2 * a.steps * a.grad_accum * procs() * 4))
    generate(CHAT, n)
    t0 = time.perf_counter()
    subprocess.check_call([sys.executable, "-m", "zerotune", "prepare", str(RECIPE.relative_to(REPO)),
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
    from zerotune.planner.memory import model_shape

    limits = measure(base, a.seq_len, seconds=a.limit_seconds)  # this machine's fp32 matmul rate at the model's shapes
    print(f"bench_train: {describe(limits)}", flush=True)
    shape = model_shape(recipe_)
    fpt = flops_per_token(shape.n_params, shape.layers, shape.hidden, a.seq_len)

    repeats = []
    for rep in range(a.repeats):
        this = {}
        for c in configs:
            if c.startswith("trl") and rep >= a.trl_repeats:
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

    ab = None
    if a.ab_steps and {"zerotune", "trainer_padded"} <= set(configs):
        log = WORK / "log-ab.txt"
        out = WORK / "probe-ab.json"
        spec_ab = {**spec, "kind": "ab", "micro_batch": b, "steps": a.ab_steps, "out": str(out)}
        (WORK / "spec-ab.json").write_text(json.dumps(spec_ab))
        t0 = time.perf_counter()
        _run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs()}",
              "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(Path(__file__).resolve()),
              "--worker", str(WORK / "spec-ab.json")], log, dict(env, DS_ACCELERATOR="cpu"))
        ab = {**ab_summary(json.loads(out.read_text()), long_eff), "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"bench_train: same-job A/B: packed {ab['packed']['ms_per_processed_token_wall']:.2f} vs padded "
              f"{ab['padded']['ms_per_processed_token_wall']:.2f} ms per processed token (wall), implied label-token "
              f"ratio {ab['implied_label_token_ratio_wall']:.2f}x wall, {ab['implied_label_token_ratio_cpu']:.2f}x CPU",
              flush=True)

    keys = ("label_tokens_per_s", "label_tokens_per_s_long_run", "label_tokens_per_cpu_s_long_run",
            "model_flops_per_s", "of_matmul_limit", "of_matmul_limit_cpu_s",
            "real_tokens_per_s", "processed_tokens_per_s", "cpu_utilisation", "efficiency", "efficiency_long_run",
            "peak_mem_gib",
            "label_tokens_per_step", "real_tokens_per_step", "wall_s", "startup_and_teardown_s")
    median = {c: {k: statistics.median(r[c][k] for r in repeats if c in r) for k in keys} for c in configs}
    ratios = {}
    if "trainer_padded" in configs:
        for key in METRICS:
            ratios[key] = {}
            for c in configs:
                if c == "trainer_padded":
                    continue
                ratios[key][c] = ratio_stats([r[c][key] / r["trainer_padded"][key] for r in repeats if c in r])
    notes = [
        "Label tokens = tokens with a loss (assistant turns incl. their end-of-turn token); identical token ids and "
        "labels for zerotune, the Trainer baseline (bench_data.baseline) and TRL with assistant_only_loss=True "
        f"({label_check['identical_ids_and_labels'] if label_check else 'n/a'}/"
        f"{label_check['conversations'] if label_check else 'n/a'} conversations checked for TRL, which trains "
        f"SmolLM2 through bench/recipes/chatml_training.jinja: TRL ships no training template for its ChatML).",
        f"Padded micro-batch = {b} documents per rank ({a.seq_len} x packing efficiency {pack_eff} / mean document "
        f"{pad['mean_doc_tokens']:.0f} tokens). Expected padding efficiency of random micro-batches on this data: "
        + ", ".join(f"{k} docs {pad_eff[k]:.2f}" for k in (1, 2, 4, 8)) + ".",
        "Every contender's TrainingArguments come from zerotune.train.training_kwargs(the bench recipe): the same "
        "optimizer, schedule, precision, DeepSpeed config and gradient checkpointing; LoRA uses the recipe's "
        "peft defaults (r 16 on every linear layer of the blocks).",
        "Model FLOPs = 6N + attention per processed token (zerotune.metrics.flops_per_token; LoRA is counted the "
        "same, although it skips the frozen weights' gradients). The limit is the fp32 matmul rate of both cores "
        "at the model's shapes, measured by bench/bench_limits.py in this run; gradient checkpointing adds a "
        "second forward (hardware FLOPs 8N), which the fraction does not count.",
        "Peak memory is the max RSS of a worker process (ru_maxrss) over ranks, so it includes the Python, "
        "torch and DeepSpeed baseline of each process (~0.8 GiB here) besides the model, activations and logits.",
    ]
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
        "median": median, "ratio_vs_trainer_padded": ratios, "repeats": repeats, "notes": notes,
        "wall_s": round(time.perf_counter() - t_all, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"bench_train: {res['wall_s']:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
