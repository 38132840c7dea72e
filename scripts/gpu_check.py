#!/usr/bin/env python
"""GPU acceptance kit: zerotune's GPU-only paths for real, as a V100 runs them, beside the plan (docs/gpu_check.md).

    make gpu-check                                   # the default rows, as a V100-SXM2-32GB
    make gpu-check ARGS="--quick --out runs/gpu_check/h200"
    make gpu-check ARGS="--as native"                # the card as itself (bf16 on sm80+, all its memory)

Without a CUDA device it prints one line and exits 0. With one, each check runs in its own process (its own CUDA
context, peak statistics, Liger patches and emulation; a crash is that check's FAIL row) and gives rows: ok / FAIL /
skipped with the reason, peak max_memory_allocated / max_memory_reserved, seconds, and the plan where it has one.
--out DIR gets gpu_check.json, gpu_check.md and logs/. Exit 1 if a row FAILs.

--as v100-32gb (the default) runs every row inside zerotune.emulation.emulate: zerotune's choice for a V100
(hardware.choose: fp16 with DeepSpeed's loss scaler, sdpa_docs, Liger on, no FlashAttention 2), SDPA's
memory-efficient kernel only (a call it cannot take is a FAIL naming the call), the allocator capped at what a
V100 leaves it, and the capability Liger and DeepSpeed read answering (7, 0).

The training rows run train/worker.py's own functions in its order (kit_trainer: load_model, build_trainer,
choose_resume, train_or_stop), with train/args.py's TrainingArguments and ds_config.build's DeepSpeed config; only
setup() is replaced (kit_run), because it reads prepared data and the real card.

Rows and their expected time on an H100/H200, process start and set-up included (estimates scaled from the
2026-11-26 H200 run; no row below has been timed yet):
  fp16_loss_scale  ~30 s  a tiny Llama through the worker's Trainer in fp16: steps whose loss is x1e20 are skipped
                          and leave the weights alone, the scale halves after `hysteresis`, the next step applies.
  sdpa_packed      ~20 s  two packed documents under sdpa_docs and sdpa (dense block-causal mask): logits equal
                          each document's alone, forward + backward; flash_attention_2 where the card has it.
  liger            ~25 s  Llama patched by families.apply_liger: loss and gradients against fp32, eval logits, and
                          validation (train.validation.nll_sum) without a seq x vocab tensor.
  liger_families   ~30 s  the same for Qwen3 and Gemma 3 at a shape that uses Liger's block RMSNorm.
  attention_ab     ~100 s issue 40: the Llama-3.2-1B shape at --seq[0], sdpa_docs vs sdpa: step time, peak memory,
                          equal losses, each beside its plan.
  zero3_8b         ~150 s Llama-3.1-8B's width with as many layers as the planner fits one card at ZeRO-3 world size
                   +45 s  1: train, validation, samples, save, resume (a fresh process) at --seq[0]; train alone at
                          the others (512: ZeRO-3's per-module overhead). Seconds per micro-step beside the plan.
  sp_attention     ~40 s  issue 52: what one GPU of a 32K row on 2 GPUs attends after DeepSpeed's Ulysses exchange
                          (16 query, 4 K/V heads x 32K tokens, one 32K document and a mix), forward + backward under
                          sdpa_docs in the card's kernels, its peak within the plan's one-layer recompute. The exchange
                          itself (all-to-alls, their time) needs 2+ GPUs: not shown by one card.
  zero3_1b         ~110 s (not by default) the Llama-3.2-1B shape, every phase at each --seq.
  Default ~8 min; --quick ~5 min (no liger_families; the 8B slice trains, validates, samples at --seq[0] only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's zerotune, whichever one the environment has installed
from zerotune.emulation import TARGETS  # noqa: E402

WORKER = Path(__file__).resolve().with_name("gpu_check_worker.py")  # what runs in each check's own process

GiB = 1024 ** 3
CHECKS = ("fp16_loss_scale", "sdpa_packed", "liger", "liger_families", "attention_ab", "zero3_8b", "sp_attention",
          "zero3_1b")
QUICK = ("fp16_loss_scale", "sdpa_packed", "liger", "attention_ab", "zero3_8b", "sp_attention")
PHASES = ("train", "validation", "samples", "save", "resume")
PLAN_PHASES = {"train": "train_step", "validation": "validation", "samples": "samples", "save": "save",
               "resume": "resume"}  # ours -> planner/phases.py phase_plan's GPU phases
SHAPES = {"1b": REPO / "configs/models/llama32_1b.json", "8b": REPO / "configs/models/llama31_8b.json"}
NEW_TOKENS = 16  # the samples phase's greedy tokens (check.max_new_tokens: what the planner counts)
ROW_MARK = "GPU_CHECK_PAYLOAD "  # a worker's last stdout line: this marker + JSON
NO_GPU_LINE = ("gpu_check: no CUDA device: nothing to check (on a CUDA GPU, as a V100 unless --as native, it checks: "
               "fp16 dynamic loss scaling under DeepSpeed ZeRO-3, SDPA with packed rows (sdpa_docs, sdpa), Liger's "
               "Triton kernels, sdpa_docs vs sdpa on a Llama-3.2-1B shape, and a Llama-3.1-8B-wide slice through the "
               "worker per phase - train, validation, samples, save, resume - at seq {seqs} beside the plan)")


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

def _check_list(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CHECKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {bad or text!r}; choose from {', '.join(CHECKS)}")
    return names


def _int(low: int, step: int = 1):
    def parse(text: str) -> int:
        v = int(text)
        if v < low or v % step:
            raise argparse.ArgumentTypeError(f"{v}: needs a multiple of {step}, at least {low}")
        return v
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description="Run zerotune's GPU-only paths for real on this "
                                "machine's first CUDA device, as a V100 would (--as), beside the planner.")
    p.add_argument("--as", dest="target", choices=(*TARGETS, "native"), default="v100-32gb",
                   help="the card every row runs as (default v100-32gb; native: this card as itself)")
    p.add_argument("--checks", type=_check_list, default=None,
                   help=f"comma-separated subset of {','.join(CHECKS)} (default: all but zero3_1b)")
    p.add_argument("--quick", action="store_true", help="~4 minutes: no liger_families; the 8B slice trains, "
                   "validates and samples at the first --seq only")
    p.add_argument("--seq", type=_int(128, 64), nargs="+", default=[16384, 512],
                   help="sequence lengths of the ZeRO-3 rows (default 16384 512; attention_ab uses the first)")
    p.add_argument("--steps", type=_int(1), default=3, help="optimizer steps per ZeRO-3 row (GA 2 each)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check",
                   help="folder for gpu_check.json, gpu_check.md and logs/ (default runs/gpu_check)")
    p.add_argument("--tmpdir", default=None, help="where base models and checkpoints go (~25 GB, removed after)")
    p.add_argument("--timeout", type=_int(1), default=900, help="seconds per worker process (default 900)")
    a = p.parse_args(argv)
    a.checks = a.checks or list(QUICK if a.quick else CHECKS[:-1])
    return a


# --------------------------------------------------------------------------------------------------------------
# Models, recipes and the plan (CPU-safe)
# --------------------------------------------------------------------------------------------------------------

def small_config(family: str, **over) -> dict:
    """configs/models/tiny_<family>.json widened to the 8B models' head_dim 128 (8 query heads x a 4,096-token row
    = 32,768 q-norm rows: Liger's block RMSNorm, liger_kernel ops/rms_norm.py n_cols <= 256 and n_rows >= 4096 *
    8), 2 layers, vocab 32,000; `over` overrides."""
    cfg = json.loads((REPO / f"configs/models/tiny_{'llama31' if family == 'llama' else family}.json").read_text())
    cfg.update(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=4, head_dim=128, use_cache=False, bos_token_id=0,
               eos_token_id=1, pad_token_id=0, initializer_range=0.05 if family == "qwen3" else 0.02)
    if family == "gemma3":  # one sliding and one global layer; llama.cpp's scaling (families.llama_cpp_problems)
        cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=512, query_pre_attn_scalar=128)
    return {**cfg, **over}


def shape_config(shape: str, layers: int | None = None) -> dict:
    """configs/models/<shape>.json, with only `layers` decoder layers (None: all)."""
    cfg = json.loads(SHAPES[shape].read_text())
    return {**cfg, "num_hidden_layers": layers} if layers is not None else cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def zero3_recipe(name: str, config: Path, out: Path, seq: int, steps: int, attention: str = "auto",
                 plan_gpu: str = "v100-32gb", ga: int = 2) -> dict:
    """A ZeRO-3 row as a zerotune recipe, read by the planner, train/args.py and the worker. The model comes from
    model.init_config, as the planner has always been fed here; data.heldout makes it plan the samples phase."""
    return {"name": name, "output_dir": str(out), "model": {"init_config": str(config)},
            "data": {"seq_len": seq, "packing": True, "eval_fraction": 0.01, "heldout": "data/tiny/heldout.jsonl"},
            "train": {"global_batch_tokens": ga * seq, "micro_batch_size": 1, "max_steps": steps,
                      "attention": attention, "liger": "auto", "gradient_checkpointing": True,
                      "deepspeed": "configs/deepspeed/zero3.json", "save_steps": 0, "report_to": "none"},
            "check": {"max_new_tokens": NEW_TOKENS}, "plan": {"gpu": plan_gpu, "gpus_per_node": 1, "nodes": 1}}


def recipe(d: dict):
    from zerotune.config import from_dict

    return from_dict(json.loads(json.dumps(d)), where="gpu_check")


def predict(rec: dict, plan_gpu: str, card: str | None) -> dict:
    """The plan of a ZeRO-3 row: per-phase memory on one `plan_gpu` (compute_plan: allocated and reserved views,
    the peak with its overheads) and its step time there; the same step on this `card` at its own peak and the
    emulated choice (Target.step_time), with the FLOPs per micro-step."""
    from zerotune import hardware
    from zerotune.planner import compute as planmod
    from zerotune.planner.target import resolve

    r = recipe(rec)
    p = planmod.compute_plan(r, gpu=plan_gpu, gpus_per_node=1, nodes=1)
    phases = {ours: getattr(p.phases, name) for ours, name in PLAN_PHASES.items()}
    out = {"plan_gpu": plan_gpu, "card": card, "n_params": p.model.n_params,
           "capacity": p.cluster.capacity_bytes, "precision": p.choice.precision,
           "attention": p.choice.attention, "micro_s": None,
           "phases": {ours: (ph.views.allocated, ph.views.reserved, ph.peak_bytes)
                      for ours, ph in phases.items() if ph is not None and ph.views is not None},
           "target_micro_s": p.time.per_micro_step.compute_s if p.time.per_micro_step else None,
           "target_step_s": p.time.seconds_per_step}
    g = hardware.GPUS.get(card or "")
    if g and g.peak_tflops:
        # the same step on this card, in the plan's (emulated) precision and attention, its documents unmeasured
        t = dataclasses.replace(resolve(r, gpu=card, gpus_per_node=1, nodes=1), choice=p.choice, docs=None)
        st = t.step_time(r.data.seq_len, 1, 1)
        out.update(micro_s=st.per_micro_step.compute_s, step_s=st.seconds_per_step, mfu=st.mfu,
                   flops_micro=st.flops_per_step / st.grad_accum,
                   peak_tflops=hardware.peak_tflops(g, out["precision"]))
    return out


def plan_note(pred: dict, micro_s: float | None) -> str:
    out = f"plan gpu {pred['plan_gpu']}"
    if pred.get("micro_s"):
        out += (f"; plan on {pred['card']} ({pred['peak_tflops']:g} TFLOPS x MFU {pred['mfu']:g}): compute "
                f"{pred['micro_s']:.3f} s per micro-step, step {pred['step_s']:.2f} s")
        if micro_s:
            out += f"; measured {pred['flops_micro'] / micro_s / (pred['peak_tflops'] * 1e12):.0%} of its peak"
    if pred.get("target_micro_s"):
        out += (f"; on {pred['plan_gpu']}: compute {pred['target_micro_s']:.3f} s per micro-step, step "
                f"{pred['target_step_s']:.2f} s")
    return out


def slice_layers(plan_gpu: str, seq: int, steps: int, root: Path, max_layers: int = 32) -> tuple[int, int]:
    """(layers, planned train-step peak): the most decoder layers of Llama-3.1-8B's width whose training step the
    planner fits on one `plan_gpu` at ZeRO-3 world size 1 (0 if none); each candidate fed as the rows are."""
    from zerotune.planner import compute as planmod

    def peak(n):
        cfg = write_config(root / f"8b-{n}L.json", shape_config("8b", n))
        p = planmod.compute_plan(recipe(zero3_recipe(f"slice{n}", cfg, root / "plan", seq, steps, plan_gpu=plan_gpu)),
                                 gpu=plan_gpu, gpus_per_node=1, nodes=1)
        return p.memory.peak_bytes, p.memory.capacity_bytes

    lo, hi, best = 1, max_layers, (0, 0)
    while lo <= hi:  # the peak grows with the layers
        mid = (lo + hi) // 2
        pk, cap = peak(mid)
        best, lo, hi = ((mid, pk), mid + 1, hi) if pk <= cap else (best, lo, mid - 1)
    return best


# --------------------------------------------------------------------------------------------------------------
# Rows and the report
# --------------------------------------------------------------------------------------------------------------

def _reason(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:400]}" if msg else type(e).__name__


def make_row(check: str, status: str, detail: str = "", *, allocated=None, reserved=None, seconds=None,
             predicted_allocated=None, predicted_reserved=None, predicted_seconds=None) -> dict:
    assert status in ("ok", "FAIL", "skipped"), status
    return {"check": check, "status": status, "detail": detail, "allocated_bytes": allocated,
            "reserved_bytes": reserved, "seconds": seconds, "predicted_allocated_bytes": predicted_allocated,
            "predicted_reserved_bytes": predicted_reserved, "predicted_seconds": predicted_seconds}


COLUMNS = ("check", "status", "alloc GiB", "reserved GiB", "pred alloc", "pred reserved", "alloc/pred", "time s",
           "plan s", "detail")


def _cells(r: dict) -> list[str]:
    def gib(b):
        return "-" if b is None else f"{b / GiB:.2f}"

    a, pa, s, ps = (r.get(k) for k in ("allocated_bytes", "predicted_allocated_bytes", "seconds", "predicted_seconds"))
    return [r["check"], r["status"], gib(a), gib(r.get("reserved_bytes")), gib(pa),
            gib(r.get("predicted_reserved_bytes")), f"{a / pa:.2f}" if a and pa else "-",
            "-" if s is None else f"{s:.3g}", "-" if ps is None else f"{ps:.3g}", r.get("detail") or ""]


def format_table(rows: list[dict]) -> str:
    """Fixed-width table; the detail column last, unpadded."""
    body = [_cells(r) for r in rows]
    widths = [max(len(x[i]) for x in [COLUMNS, *body]) for i in range(len(COLUMNS) - 1)]

    def line(cells):
        out = [c.rjust(w) if 2 <= i <= 8 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join([*out, cells[-1]]).rstrip()

    return "\n".join([line(COLUMNS), line(["-" * w for w in widths] + ["-" * 6]), *(line(b) for b in body)])


def format_markdown(info: dict, rows: list[dict]) -> str:
    cells = [[c.replace("|", "\\|") for c in _cells(r)] for r in rows]
    return "\n".join(["# gpu_check", "", *(f"- {x.removeprefix('gpu_check: ')}" for x in header_lines(info)), "",
                      "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
                      *("| " + " | ".join(c) + " |" for c in cells)]) + "\n"


def header_lines(info: dict) -> list[str]:
    cap, v, e = info.get("capability") or [0, 0], info.get("versions", {}), info.get("emulation") or {}
    total = info.get("total_memory", 0)
    lines = [f"gpu_check: {info.get('name')} (sm{cap[0]}{cap[1]}, capability {cap[0]}.{cap[1]}), {total / GiB:.2f} "
             f"GiB total as PyTorch reports it ({total:,} bytes), {info.get('device_count')} device(s) visible, "
             "using device 0",
             f"gpu_check: torch {v.get('torch')} (CUDA {info.get('cuda')}, kernels for "
             f"{', '.join(info.get('arch_list', []))}), " + ", ".join(
                 f"{k} {v.get(k)}" for k in ("transformers", "deepspeed", "liger-kernel", "accelerate", "triton",
                                             "flash-attn"))]
    if e.get("target", "native") != "native":
        lines.append(f"gpu_check: rows run as {e['target']} (--as): " + "; ".join(e["emulated"]))
    return lines + ["gpu_check: not emulated: " + "; ".join(e.get("not_emulated") or ["?"])]


# --------------------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------------------

def crash_reason(rc: int, stderr: str) -> str:
    """One line for a worker that died without a payload: the last error-looking line of its stderr."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    err = next((x for x in reversed(lines) if "Error" in x or "error:" in x or "Killed" in x), lines[-1] if lines else "")
    sig = f" (signal {-rc}{': killed, host out of memory?' if rc == -9 else ''})" if rc < 0 else ""
    return f"worker exited {rc}{sig} without a result: {err[:300]}".rstrip(": ")


def run_worker(name: str, spec: dict, a, log_dir: Path, label: str) -> dict:
    """`name` in a fresh process with `spec`; its payload, or a FAIL row with the reason; the log under log_dir."""
    import torch

    (log_dir / f"{label}.spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, str(WORKER), name, str(log_dir / f"{label}.spec.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cuda" if torch.cuda.is_available() else "cpu", PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # every model here is built from a local config
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log = log_dir / f"{label}.log"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env, cwd=str(REPO))
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = *(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)), None
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    if rc is None:
        return {"rows": [make_row(label, "FAIL", f"timed out after {a.timeout} s (--timeout); log {log}")]}
    payload = next((json.loads(x[len(ROW_MARK):]) for x in reversed(out.splitlines()) if x.startswith(ROW_MARK)), None)
    return payload or {"rows": [make_row(label, "FAIL", crash_reason(rc, err) + f"; log {log}")]}


class Kit:
    """What the parent's rows share: the arguments, the card and its emulation, the temp root, the log folder."""

    def __init__(self, a, info: dict, root: Path, log_dir: Path, emit=lambda r: r):
        self.a, self.info, self.root, self.log_dir, self.emit = a, info, root, log_dir, emit
        self.plan_gpu = (info.get("emulation") or {}).get("gpu_key") or "v100-32gb"
        self.card = info.get("card")

    def worker(self, name: str, spec: dict, label: str) -> dict:
        return run_worker(name, {"as": self.a.target, **spec}, self.a, self.log_dir, label)

    def simple(self, check: str, spec: dict | None = None, label: str | None = None) -> list[dict]:
        return [self.emit(r) for r in self.worker(check, spec or {}, label or check)["rows"]]

    def zero3(self, tag: str, label: str, config: Path, seq: int, phases, attention: str = "auto", note: str = "",
              out: Path | None = None) -> tuple[list, dict]:
        """One ZeRO-3 row set: the plan here, the phases in a worker, resume in a fresh one. The run folder
        (`out`, default one per label) holds the base and the checkpoint; the caller removes a shared one."""
        out = out or self.root / label
        rec = zero3_recipe(label, config, out, seq, self.a.steps, attention, self.plan_gpu)
        try:
            pred = predict(rec, self.plan_gpu, self.card)
        except Exception as e:
            traceback.print_exc()
            return [self.emit(make_row(f"{tag}: train", "FAIL", f"no plan: {_reason(e)}"))], {}
        spec = {"recipe": rec, "tag": tag, "phases": [p for p in phases if p != "resume"], "n_params": pred["n_params"],
                "expect": {"peaks": {ph: v[2] for ph, v in pred["phases"].items()}, "capacity": pred["capacity"]}}
        payload = self.worker("zero3", spec, label)
        info = payload.get("info") or {}

        def with_plan(row):
            phase = row["check"].rsplit(": ", 1)[-1]
            if phase in pred["phases"]:
                row["predicted_allocated_bytes"], row["predicted_reserved_bytes"], _ = pred["phases"][phase]
            if phase == "train":
                row["predicted_seconds"] = pred["micro_s"]
                row["detail"] += "; " + plan_note(pred, info.get("micro_s")) + note
            return self.emit(row)

        rows = [with_plan(r) for r in payload["rows"]]
        if "resume" in phases:
            if not info.get("saved"):
                rows.append(with_plan(make_row(f"{tag}: resume", "skipped", "nothing was saved (save row)")))
            else:
                resume = {"fingerprint": info.get("fingerprint"), "val_loss": info.get("val_loss")}
                rows += [with_plan(r) for r in self.worker("zero3", {**spec, "resume": resume}, label + "_resume")["rows"]]
        if out == self.root / label:
            shutil.rmtree(out, ignore_errors=True)  # base and checkpoint: ~18 B per parameter
        return rows, info


def rows_fp16_loss_scale(kit: Kit) -> list[dict]:
    from zerotune import ds_config

    cfg = write_config(kit.root / "tiny.json", small_config("llama", vocab_size=1024, hidden_size=256,
                                                            intermediate_size=512, head_dim=32))
    rec = zero3_recipe("gpu_check_fp16", cfg, kit.root / "fp16", 128, 1, ga=1)
    rec["train"]["precision"] = "fp16"  # on every card: the scaler is what this row checks
    hysteresis = int(ds_config.build(recipe(rec))["fp16"].get("hysteresis", 2))
    rec["train"]["max_steps"] = hysteresis + 2  # a normal step, `hysteresis` overflowing ones, a normal one
    return kit.simple("fp16_loss_scale", {"recipe": rec, "hysteresis": hysteresis})


def rows_attention_ab(kit: Kit) -> list[dict]:
    """Issue 40 on a GPU: per-document (sdpa_docs) against the dense block-causal mask (sdpa), one run folder so
    both load the same base weights, the same rows; the memory-efficient kernel only under --as v100-32gb."""
    seq, cfg, out, got, rows = kit.a.seq[0], write_config(kit.root / "1b.json", shape_config("1b")), kit.root / "ab", {}, []
    for attn in ("sdpa_docs", "sdpa"):
        tag = f"attention 1B {seq:,} {attn}"
        r, info = kit.zero3(tag, f"ab_{attn}", cfg, seq, ["train"], attention=attn, out=out)
        rows += r
        got[attn] = (next((x for x in r if x["check"] == f"{tag}: train" and x["status"] == "ok"), None), info)
    shutil.rmtree(out, ignore_errors=True)
    (d, di), (s, si) = got["sdpa_docs"], got["sdpa"]
    name = f"attention 1B {seq:,}: sdpa_docs vs sdpa"
    if not (d and s and di.get("losses") and si.get("losses") and di.get("micro_s") and si.get("micro_s")):
        return rows + [kit.emit(make_row(name, "skipped", "a training row above did not pass"))]
    diff = max(abs(x - y) / abs(y) for x, y in zip(di["losses"], si["losses"]))
    problems = [] if diff <= 1e-3 and len(di["losses"]) == len(si["losses"]) else ["the losses differ"]

    def gib(row, key):
        return (row[key] or 0) / GiB

    detail = (f"losses equal to {diff:.1e} relative (tol 1e-3); micro-step {di['micro_s']:.3f} vs {si['micro_s']:.3f} s:"
              f" sdpa_docs {si['micro_s'] / di['micro_s']:.2f}x faster (plan {(s['predicted_seconds'] or 0) / (d['predicted_seconds'] or 1):.2f}x);"
              f" peak allocated {gib(s, 'allocated_bytes') - gib(d, 'allocated_bytes'):+.2f} GiB with the dense mask "
              f"(plan {gib(s, 'predicted_allocated_bytes') - gib(d, 'predicted_allocated_bytes'):+.2f})")
    return rows + [kit.emit(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]),
                                     seconds=di["micro_s"], predicted_seconds=d["predicted_seconds"]))]


def rows_zero3_8b(kit: Kit) -> list[dict]:
    """Llama-3.1-8B's width with the layers slice_layers fits, at each --seq (every phase at the first)."""
    seqs = kit.a.seq[:1] if kit.a.quick else kit.a.seq
    layers, peak = slice_layers(kit.plan_gpu, seqs[0], kit.a.steps, kit.root / "slices")
    if not layers:
        return [kit.emit(make_row("8B slice: train", "skipped", f"not one layer of Llama-3.1-8B's width fits a "
                                  f"{kit.plan_gpu} at ZeRO-3 world size 1 at {seqs[0]:,} tokens (planner)"))]
    cfg = write_config(kit.root / f"8b-{layers}L.json", shape_config("8b", layers))
    note = (f"; {layers} of 32 layers: the most whose training step the planner fits one {kit.plan_gpu} at ZeRO-3 "
            f"world size 1 at {seqs[0]:,} tokens ({peak / GiB:.2f} GiB planned peak)")
    out, rows = kit.root / "slice8b", []
    for i, seq in enumerate(seqs):
        phases = (PHASES[:3] if kit.a.quick else PHASES) if i == 0 else ("train",)
        rows += kit.zero3(f"8B slice {layers}L {seq:,}", f"slice8b_{seq}", cfg, seq, phases, note=note, out=out)[0]
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the next seq starts from the same base
    shutil.rmtree(out, ignore_errors=True)
    return rows


def rows_zero3_1b(kit: Kit) -> list[dict]:
    cfg, out = write_config(kit.root / "1b.json", shape_config("1b")), kit.root / "zero3_1b"
    rows = []
    for seq in kit.a.seq:
        rows += kit.zero3(f"1B {seq:,}", f"zero3_1b_{seq}", cfg, seq, PHASES, out=out)[0]
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return rows


ROWS = {"fp16_loss_scale": rows_fp16_loss_scale,
        "sdpa_packed": lambda kit: kit.simple("sdpa_packed"),
        "liger": lambda kit: kit.simple("liger", {"families": ["llama"]}),
        "liger_families": lambda kit: kit.simple("liger", {"families": ["qwen3", "gemma3"]}, "liger_families"),
        "attention_ab": rows_attention_ab, "zero3_8b": rows_zero3_8b, "zero3_1b": rows_zero3_1b,
        # a 32K row on 2 GPUs: one GPU's attention after the exchange (the exchange itself needs 2+ GPUs)
        "sp_attention": lambda kit: kit.simple("sp_attention", {"seq": 32768, "sp": 2, "plan_gpu": kit.plan_gpu})}


def main(argv: list[str] | None = None) -> int:
    import torch

    a = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU_LINE.format(seqs=", ".join(map(str, a.seq))), flush=True)
        return 0

    out = a.out if a.out.is_absolute() else Path.cwd() / a.out
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = run_worker("env", {"as": a.target}, a, log_dir, "env")
    info = env.get("info") or {}
    if not info or info.get("emulation_error"):
        print("gpu_check: " + info.get("emulation_error", "could not query the GPU: " + (
            env["rows"][0]["detail"] if env.get("rows") else "?")), flush=True)
        return 1
    for line in header_lines(info):
        print(line, flush=True)

    def emit(row):
        print(f"gpu_check: {row['status']:<7} {row['check']}: {row['detail']}", flush=True)
        return row

    if a.tmpdir:
        Path(a.tmpdir).mkdir(parents=True, exist_ok=True)
    root, rows, t0 = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=a.tmpdir)), [], time.time()
    try:
        kit = Kit(a, info, root, log_dir, emit)
        for check in a.checks:
            rows += ROWS[check](kit)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failed = sum(r["status"] == "FAIL" for r in rows)
    print("\n" + format_table(rows))
    result = {"device": info, "args": {k: getattr(a, k) for k in ("target", "checks", "seq", "steps", "quick")},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - t0, 1), "rows": rows,
              "failed": failed}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_check.md").write_text(format_markdown(info, rows))
    print(f"\ngpu_check: {len(rows)} rows, {failed} failed, {result['seconds']:.0f} s; {out}/gpu_check.json and "
          f"gpu_check.md; logs {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
