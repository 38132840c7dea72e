#!/usr/bin/env python
"""GPU acceptance kit: run the GPU-only paths of zerotune for real and compare them with the plan.

    make gpu-check                                   # .venv/bin/python scripts/gpu_check.py
    srun --gres=gpu:1 make gpu-check                 # on a SLURM cluster
    .venv/bin/python scripts/gpu_check.py --seq 2048 --checks zero3_1b --out runs/gpu_check/v100.json

Without a CUDA device it prints one line saying so and exits 0. With one, every check below runs in its own
process (its own CUDA context, allocator statistics and Liger patches; a crash or an OOM stays a FAIL row of
that check) and inside it in its own try block; each prints one row (or one row per phase): status ok / FAIL /
skipped with the reason, peak torch.cuda.max_memory_allocated and max_memory_reserved, time, and the planner's
prediction where it has one. The table is printed and written as JSON (--out). Exit 1 if any row FAILs.

  fp16_loss_scale  a tiny Llama under DeepSpeed ZeRO-3 (world size 1) in fp16 with the repo's zero3.json and
                   its loss-scale rule (ds_config.build); overflowing steps (loss x 1e20) are skipped, leave the
                   weights alone, and the scale halves after `hysteresis` of them; the next normal step applies.
  sdpa_packed      two documents packed in one row (position_ids restart at 0), attn sdpa, fp16, training mode:
                   packed logits equal per-document logits; SDPA's memory-efficient kernel forced with the mask
                   runs forward and backward; which backend SDPA picks by itself; flash_attention_2 (varlen) on
                   sm80+ when flash_attn is installed.
  liger            Liger's real Triton kernels (RoPE, RMSNorm, SwiGLU, fused linear cross entropy) on a small
                   Llama in fp16 against the unpatched model: loss and gradients in training mode, logits in eval;
                   eval with labels and skip_logits=True matches the loss and never materialises seq x vocab.
  liger_families   the same for Qwen3 (fp16) and Gemma 3 (bf16, or fp32 without it; never fp16), patched through
                   families.apply_liger as the worker does, head_dim 128 and 32,768 q-norm rows: Liger's block
                   RMSNorm kernel, which Qwen3-8B's and Gemma 3's q/k norms use and a Llama never does.
  zero3_1b         a Llama-3.2-1B-shaped model (random init) through the repo's training path (hardware.choose,
                   train/args.py training_kwargs, ds_config.build, HF Trainer + DeepSpeed ZeRO-3, gradient
                   checkpointing, Liger, fp16 below sm80 else bf16, sdpa with packed rows) at each --seq, per phase:
                   train (optimizer steps at GA 2), validation (validation.nll_sum with Liger's fused loss), samples
                   (generate 16 tokens after a seq-long prompt), save (the Trainer's checkpoint: 16-bit
                   consolidation + engine.save_checkpoint), resume (a fresh process resumes through
                   Trainer.train(resume_from_checkpoint=...) -> engine.load_checkpoint, as a requeued job does;
                   weights, fp32 master, loss scale and step must equal what was saved). Predicted columns:
                   zerotune.planner.compute.compute_plan on one GPU of this kind (memory views; planner/phases.py per phase).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import zerotune  # noqa: F401  (installed into .venv by make setup)
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(REPO / "src"))

GiB = 1024 ** 3
CHECKS = ("fp16_loss_scale", "sdpa_packed", "liger", "liger_families", "zero3_1b")
PHASES = ("train", "validation", "samples", "save", "resume")
DEFAULT_SEQ = (2048, 4096)
DEFAULT_OUT = REPO / "runs" / "gpu_check" / "gpu_check.json"
ROW_MARK = "GPU_CHECK_PAYLOAD "  # the worker's last stdout line: this marker + JSON
LLAMA32_1B_CONFIG = REPO / "configs" / "models" / "llama32_1b.json"
ZERO3_JSON = "configs/deepspeed/zero3.json"
# Llama-3.2-1B shape, counted by hand (tied embeddings: the 128,256 x 2,048 matrix once):
#   embeddings 128,256 x 2,048                                   = 262,668,288
#   per layer: q, o 2,048 x 2,048 (x2)                           =   8,388,608
#              k, v 2,048 x 512 (8 KV heads x 64) (x2)           =   2,097,152
#              gate, up, down 2,048 x 8,192 (x3)                 =  50,331,648
#              2 RMSNorm weights x 2,048                         =       4,096
#              = 60,821,504 per layer, x 16 layers               = 973,144,064
#   final RMSNorm 2,048                                          =       2,048
#   total                                                        = 1,235,814,400
LLAMA32_1B_PARAMS = 1_235_814_400
N_VAL_ROWS = 2  # validation rows of the 1B check (one forward each)
NEW_TOKENS = 16  # generated by the 1B check's samples phase
OVERFLOW_FACTOR = 1e20  # loss x this: fp16 gradients overflow to inf at any loss scale >= 1
NO_GPU_LINE = ("gpu_check: no CUDA device: nothing to check (on a CUDA GPU it checks: fp16 dynamic loss scaling under "
               "DeepSpeed ZeRO-3, SDPA memory-efficient kernel with the packed block-causal mask (+ flash_attention_2 "
               "on sm80+), Liger's Triton kernels, and a Llama-3.2-1B-shaped ZeRO-3 run per phase - train, "
               "validation, samples, save, resume - at seq {seqs} beside the planner's prediction)")


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

def _check_list(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CHECKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown check(s) {bad or text!r}; choose from {', '.join(CHECKS)}")
    return names


def _seq(text: str) -> int:
    v = int(text)
    if v < 64 or v % 2:
        raise argparse.ArgumentTypeError(f"--seq {v}: needs an even length >= 64 (two packed documents per row)")
    return v


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 1")
    return v


WORKERS = ("env", "fp16_loss_scale", "sdpa_packed", "liger", "liger_families", "zero3_1b", "zero3_1b_resume")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description="Run zerotune's GPU-only paths for real on this "
                                "machine's first CUDA device and compare with the planner (no GPU: exits 0).")
    p.add_argument("--seq", type=_seq, nargs="+", default=list(DEFAULT_SEQ),
                   help="sequence lengths for the 1B-shaped ZeRO-3 check (default: 2048 4096)")
    p.add_argument("--checks", type=_check_list, default=list(CHECKS),
                   help=f"comma-separated subset of {','.join(CHECKS)} (default: all)")
    p.add_argument("--steps", type=_positive, default=3, help="optimizer steps of the 1B check (GA 2 each; default 3)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default runs/gpu_check/gpu_check.json)")
    p.add_argument("--tmpdir", default=None, help="where the 1B check writes its checkpoint (~20 GB; "
                   "default: the system temp dir)")
    p.add_argument("--timeout", type=_positive, default=1800, help="seconds per check process (default 1800)")
    p.add_argument("--force", action="store_true", help="run the 1B check even where the planner predicts it does "
                   "not fit this card")
    # internal: one check in this process (the parent starts these)
    p.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--expect", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------------------
# Rows and the table
# --------------------------------------------------------------------------------------------------------------

def make_row(check: str, status: str, detail: str = "", *, allocated=None, reserved=None, seconds=None,
             predicted_allocated=None, predicted_reserved=None) -> dict:
    assert status in ("ok", "FAIL", "skipped"), status
    return {"check": check, "status": status, "detail": detail, "allocated_bytes": allocated,
            "reserved_bytes": reserved, "seconds": seconds, "predicted_allocated_bytes": predicted_allocated,
            "predicted_reserved_bytes": predicted_reserved}


def _gib(b) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def _ratio(measured, predicted) -> str:
    return "-" if not measured or not predicted else f"{measured / predicted:.2f}"


def format_table(rows: list[dict]) -> str:
    """Fixed-width table; the detail column last, unpadded."""
    head = ("check", "status", "alloc GiB", "reserved GiB", "pred alloc", "pred reserved", "alloc/pred", "time s",
            "detail")
    body = [(r["check"], r["status"], _gib(r.get("allocated_bytes")), _gib(r.get("reserved_bytes")),
             _gib(r.get("predicted_allocated_bytes")), _gib(r.get("predicted_reserved_bytes")),
             _ratio(r.get("allocated_bytes"), r.get("predicted_allocated_bytes")),
             "-" if r.get("seconds") is None else f"{r['seconds']:.3g}", r.get("detail") or "") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    right = {2, 3, 4, 5, 6, 7}

    def line(cells):
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join([*out, cells[-1]]).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths] + ["-" * 6]), *(line(b) for b in body)])


def header_lines(info: dict) -> list[str]:
    cap = info.get("capability")
    v = info.get("versions", {})
    return [
        f"gpu_check: {info.get('name')} (sm{cap[0]}{cap[1]}, capability {cap[0]}.{cap[1]}), "
        f"{info.get('total_memory', 0) / GiB:.2f} GiB total as PyTorch reports it "
        f"({info.get('total_memory', 0):,} bytes), {info.get('device_count')} device(s) visible, using device 0",
        f"gpu_check: torch {v.get('torch')} (CUDA {info.get('cuda')}, kernels for {', '.join(info.get('arch_list', []))}), "
        + ", ".join(f"{k} {v.get(k)}" for k in ("transformers", "deepspeed", "liger-kernel", "accelerate", "triton",
                                                 "flash-attn")),
    ]


# --------------------------------------------------------------------------------------------------------------
# Models and data (CPU-safe)
# --------------------------------------------------------------------------------------------------------------

def tiny_llama_config(vocab: int = 1024, hidden: int = 256, intermediate: int = 512, layers: int = 2, heads: int = 8,
                      kv_heads: int = 4, init: float = 0.02, tie: bool = False):
    """A small Llama-3.1-architecture config (GQA, llama3 RoPE scaling); every dimension a multiple of 32."""
    from transformers import LlamaConfig

    for d in (vocab, hidden, intermediate, hidden // heads):
        assert d % 32 == 0, d
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       initializer_range=init, tie_word_embeddings=tie, use_cache=False, bos_token_id=0,
                       eos_token_id=1, pad_token_id=0)


def llama32_1b_config():
    """The Llama-3.2-1B shape the repo ships (configs/models/llama32_1b.json)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(LLAMA32_1B_CONFIG))


def meta_param_count(config) -> int:
    """Parameters of the model `config` describes, built on the meta device (no memory); tied weights once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def packed_rows(n: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """n packed rows of two documents (3/4 + 1/4 of seq): position_ids restart at 0, as data/packing.py packs;
    the first 8 tokens of each document carry no loss (a prompt)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    first = 3 * seq // 4
    rows = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (seq,), generator=g).tolist()
        labels = list(ids)
        for start in (0, first):
            labels[start:start + 8] = [-100] * 8
        rows.append({"input_ids": ids, "labels": labels,
                     "position_ids": list(range(first)) + list(range(seq - first))})
    return rows


def fill_trainer_autos(ds: dict, *, micro: int, grad_accum: int, world: int, hidden: int, precision: str,
                       max_grad_norm: float) -> dict:
    """The "auto" values the HF Trainer fills in (transformers integrations/deepspeed.py, trainer_config_process and
    trainer_config_finalize: batch sizes, clipping, fp16/bf16, hidden-size buckets), for a DeepSpeed engine built
    without the Trainer. Raises if any "auto" is left."""
    import copy

    cfg = copy.deepcopy(ds)
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro * grad_accum * world
    if cfg.get("gradient_clipping") == "auto":
        cfg["gradient_clipping"] = max_grad_norm
    for key, on in (("fp16", precision == "fp16"), ("bf16", precision == "bf16")):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") == "auto":
            cfg[key]["enabled"] = on
    zero = cfg.get("zero_optimization", {})
    for key, value in (("reduce_bucket_size", hidden * hidden), ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                       ("stage3_param_persistence_threshold", 10 * hidden)):
        if zero.get(key) == "auto":
            zero[key] = value
    left = [k for k, v in _walk(cfg) if v == "auto"]
    if left:
        raise ValueError(f"DeepSpeed config still has 'auto' for {left}")
    return cfg


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def logits_tolerance(dtype, scale: float) -> float:
    """Max |logit difference| allowed between two computations of the same logits that differ only in kernel
    (masked vs causal, fused vs unfused): a few ulps of the dtype at the logits' magnitude, summed over a few layers."""
    import torch

    rel = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]
    return rel * max(1.0, scale)


def packed_vs_documents(model, lens: tuple[int, ...], vocab: int, device, seed: int = 0, packed_ctx=None) -> dict:
    """Logits of documents packed in one row (position_ids restarting at 0) against each document alone, in the
    model's current mode with use_cache=False (the training path: transformers masking_utils.py:875-881 builds the
    block-causal mask from position_ids only without a mask and a cache). The control packs the same row without
    position_ids (one causal document): its difference must exceed the tolerance, or the comparison could not see a
    leak across documents. packed_ctx: a context manager factory around the packed forward only (e.g. a forced SDPA
    backend; the unmasked references may need another backend: transformers passes enable_gqa there)."""
    import contextlib

    import torch

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, vocab, (1, n), generator=g).to(device) for n in lens]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(device)
    with torch.no_grad():
        with (packed_ctx or contextlib.nullcontext)():
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
        alone = torch.cat([model(input_ids=d, use_cache=False).logits.float() for d in docs], dim=1)
        control = model(input_ids=ids, use_cache=False).logits.float()
    scale = float(alone.abs().max())
    dtype = next(model.parameters()).dtype
    return {"max_diff": float((packed - alone).abs().max()), "control_diff": float((control - alone).abs().max()),
            "scale": scale, "tol": logits_tolerance(dtype, scale), "ids": ids, "pos": pos}


# --------------------------------------------------------------------------------------------------------------
# The planner's prediction (CPU-safe)
# --------------------------------------------------------------------------------------------------------------

def recipe_1b(seq: int, steps: int, plan_gpu: str, out_dir: str | None = None):
    """The 1B check as a zerotune recipe: what the planner and train/args.py read. eval_fraction and heldout make
    the planner count the validation and samples phases (samples: check.max_new_tokens new tokens)."""
    from zerotune.config import from_dict

    return from_dict({
        "name": f"gpu_check_1b_{seq}",
        "output_dir": str(out_dir) if out_dir else "",
        "model": {"init_config": str(LLAMA32_1B_CONFIG)},
        "data": {"seq_len": seq, "packing": True, "eval_fraction": 0.01, "heldout": "data/tiny/heldout.jsonl"},
        "train": {"global_batch_tokens": 2 * seq, "micro_batch_size": 1, "max_steps": steps, "precision": "auto",
                  "attention": "sdpa", "liger": "on", "gradient_checkpointing": True, "deepspeed": ZERO3_JSON,
                  "report_to": "none", "save_steps": 0, "logging_steps": 1},
        "check": {"max_new_tokens": NEW_TOKENS},
        "plan": {"gpu": plan_gpu, "gpus_per_node": 1, "nodes": 1},
    }, where="gpu_check")


def plan_gpu_key(capability: tuple[int, int], name: str = "") -> str:
    """The planner's GPU entry for this card: by name and capability, else by capability, else the entry whose
    precision and Liger path the card shares (sm80+: a100-80gb, bf16 and Liger's fast path; below: v100-32gb)."""
    from zerotune import hardware

    cap = tuple(capability)
    g = hardware.gpu_for_capability(cap, name)
    for key, known in hardware.GPUS.items():
        if known == g:
            return key
    for key, known in hardware.GPUS.items():
        if known.capability == cap:
            return key
    return "a100-80gb" if cap >= (8, 0) else "v100-32gb"


# our phase -> the planner's names for it (planner/phases.py phase_plan: train_step, validation, samples, save,
# resume; save_host / resume_host / finalize / quantize are host RAM, not this GPU)
_PHASE_ALIASES = {"train": ("train_step", "train", "training", "training_step", "step"),
                  "validation": ("validation", "val", "eval", "evaluation"),
                  "samples": ("samples", "sample", "generate", "generation"),
                  "save": ("save", "checkpoint", "save_checkpoint"),
                  "resume": ("resume", "load", "load_checkpoint", "restore")}


def _overhead_keys() -> set[str]:
    """The parts calibration.overheads adds beside a phase's tensors (fragmentation, CUDA context, NCCL, load)."""
    from zerotune.planner import calibration

    return set(calibration.overheads(GiB, world=2, gpu_is_cuda=True, zero_init=False, n_params=1))


def _phase_views(entry) -> tuple[int | None, int | None, int | None]:
    """(allocated, reserved, peak) bytes of one phase of the planner. A phase is {peak_bytes, limit, parts}: its
    tensors are the parts that are not calibration overheads (what max_memory_allocated measures); reserved is
    calibration.views of them (the same rule as the training step's reserved view); peak includes the overheads
    (CUDA context, fragmentation: what must fit the card)."""
    if isinstance(entry, (int, float)):
        return int(entry), None, int(entry)
    if not isinstance(entry, dict) or entry.get("limit", "gpu") != "gpu":
        return None, None, None
    peak = entry.get("peak_bytes", entry.get("peak"))
    views = entry.get("views")
    if isinstance(views, dict):
        return views.get("allocated"), views.get("reserved"), peak
    parts = entry.get("parts")
    if isinstance(parts, dict):
        from zerotune.planner import calibration

        keys = _overhead_keys()
        tensors = sum(v for k, v in parts.items() if k not in keys)
        extra = {k: v for k, v in parts.items() if k in keys}
        return tensors, calibration.views(tensors, extra)["reserved"], peak
    return peak, None, peak


def phase_predictions(phases) -> dict:
    """{our phase: (allocated, reserved, peak)} from compute_plan()["phases"] (a dict by name or a list of dicts)."""
    if isinstance(phases, list):
        phases = {str(p.get("name") or p.get("phase")): p for p in phases if isinstance(p, dict)}
    if not isinstance(phases, dict):
        return {}
    out = {}
    for ours, names in _PHASE_ALIASES.items():
        key = next((k for k in phases if str(k).lower() in names), None)
        if key is not None:
            views = _phase_views(phases[key])
            if views[0] is not None:
                out[ours] = views
    return out


def predict_1b(seq: int, capability: tuple[int, int], name: str = "", steps: int = 3) -> dict:
    """The planner's numbers for the 1B check on this card: zerotune.planner.compute.compute_plan for the recipe above on one
    GPU of the card's kind. train: memory_breakdown's allocated and reserved views (compute_plan()["memory"]); the
    other phases from compute_plan()["phases"] (planner/phases.py) when the planner has them, else (None, ...)."""
    from zerotune.planner.compute import compute_plan

    key = plan_gpu_key(capability, name)
    p = compute_plan(recipe_1b(seq, steps, key), gpu=key, gpus_per_node=1, nodes=1)
    views = p.memory["views"]
    per_phase = phase_predictions(p.phases)
    out = {ph: per_phase.get(ph, (None, None, None)) for ph in PHASES}
    out["train"] = (views["allocated"], views["reserved"], p.memory["peak_bytes"])
    return {"plan_gpu": key, "phases": out, "peak_bytes": p.memory["peak_bytes"],
            "precision": p.choice["precision"], "has_phase_model": bool(per_phase),
            "model_params": p.model["n_params"]}


# --------------------------------------------------------------------------------------------------------------
# Worker side: measurement helpers
# --------------------------------------------------------------------------------------------------------------

class Measure:
    """Peak max_memory_allocated / max_memory_reserved and wall time of a block (reset at entry)."""

    def __init__(self):
        self.allocated = self.reserved = self.seconds = None

    def __enter__(self):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        self.seconds = time.perf_counter() - self.t0
        try:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0
            self.allocated = torch.cuda.max_memory_allocated()
            self.reserved = torch.cuda.max_memory_reserved()
        except Exception:  # a CUDA error inside the block (sticky): report that one, not this
            if exc[0] is None:
                raise
        return False

    def cols(self) -> dict:
        return {"allocated": self.allocated, "reserved": self.reserved, "seconds": self.seconds}


def _reason(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:400]}" if msg else type(e).__name__


def _fail(check: str, e: BaseException, m: Measure | None = None) -> dict:
    traceback.print_exc()  # into the check's log
    return make_row(check, "FAIL", _reason(e), **(m.cols() if m and m.seconds is not None else {}))


def _init_distributed() -> None:
    """World size 1 in this process: the env torchrun would set, then DeepSpeed's process group (nccl)."""
    import deepspeed

    from zerotune.ports import free_port

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1")):
        os.environ[k] = v
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    deepspeed.init_distributed(dist_backend="nccl")


def worker_env(a) -> dict:
    import importlib.metadata as md

    import torch

    props = torch.cuda.get_device_properties(0)
    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "liger-kernel", "accelerate", "triton", "flash-attn"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {"rows": [], "info": {"name": torch.cuda.get_device_name(0),
                                 "capability": list(torch.cuda.get_device_capability(0)),
                                 "total_memory": props.total_memory, "device_count": torch.cuda.device_count(),
                                 "cuda": torch.version.cuda, "arch_list": torch.cuda.get_arch_list(),
                                 "versions": versions}}


# --------------------------------------------------------------------------------------------------------------
# Check 1: fp16 dynamic loss scaling under DeepSpeed ZeRO-3
# --------------------------------------------------------------------------------------------------------------

def check_fp16_loss_scale(a) -> dict:
    name = "fp16 loss scale (DeepSpeed ZeRO-3)"
    m = Measure()
    try:
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM

        from zerotune import batch as batchmod
        from zerotune import ds_config
        from zerotune.config import from_dict

        seq = 128
        r = from_dict({"name": "gpu_check_fp16", "model": {"init_config": "configs/models/tiny_llama31.json"},
                       "data": {"seq_len": seq}, "train": {"global_batch_tokens": seq, "deepspeed": ZERO3_JSON}},
                      where="gpu_check")
        steps = 100
        ds = ds_config.build(r, batchmod.derive(seq, seq, 1, 1), steps)  # the repo's fp16 scale rule (GA 1)
        cfg = tiny_llama_config()
        ds = fill_trainer_autos(ds, micro=1, grad_accum=1, world=1, hidden=cfg.hidden_size, precision="fp16",
                                max_grad_norm=1.0)
        hysteresis = int(ds["fp16"].get("hysteresis", 2))
        expect_scale = 2.0 ** ds["fp16"]["initial_scale_power"]
        _init_distributed()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16, attn_implementation="sdpa")
        with m:
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                              config=ds)
            opt = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3: cur_scale / loss_scale (stage3.py:3362-3363)
            ids = torch.randint(2, cfg.vocab_size, (1, seq), device=engine.device)
            probe = engine.module.model.layers[0].self_attn.q_proj.weight  # gets a gradient every step

            def step(factor=None):
                loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
                engine.backward(loss * factor if factor else loss)
                engine.step()
                return float(loss)

            def snap():
                return probe.ds_tensor.detach().clone()  # world 1: the local partition is the whole weight

            problems = []
            s0 = float(opt.cur_scale)
            if s0 != expect_scale:
                problems.append(f"initial scale {s0:g}, config says 2^{ds['fp16']['initial_scale_power']}")
            w = snap()
            step()
            if not engine.was_step_applied() or engine.skipped_steps != 0:
                problems.append(f"a normal step was skipped at scale {s0:g} (skipped_steps {engine.skipped_steps})")
            elif torch.equal(w, snap()):
                problems.append("a normal step left the weights unchanged")
            scales = [s0]
            for k in range(1, hysteresis + 1):
                w = snap()
                step(OVERFLOW_FACTOR)
                scales.append(float(opt.cur_scale))
                want = s0 if k < hysteresis else s0 / 2
                if engine.was_step_applied() or engine.skipped_steps != k:
                    problems.append(f"overflow step {k} not skipped (skipped_steps {engine.skipped_steps})")
                if not torch.equal(w, snap()):
                    problems.append(f"overflow step {k} changed the weights")
                if scales[-1] != want:
                    problems.append(f"after overflow {k} of hysteresis {hysteresis}: scale {scales[-1]:g}, expected {want:g}")
            w = snap()
            step()
            if not engine.was_step_applied() or engine.skipped_steps != hysteresis:
                problems.append("the normal step after the overflows was skipped")
            elif torch.equal(w, snap()):
                problems.append("the normal step after the overflows left the weights unchanged")
        trail = " -> ".join(f"{s:g}" for s in scales)
        detail = (f"scale {trail} over {hysteresis} overflowing step(s) (loss x {OVERFLOW_FACTOR:g}, hysteresis "
                  f"{hysteresis}); skipped_steps {engine.skipped_steps}; weights untouched by skipped steps; "
                  f"normal steps before and after applied")
        if problems:
            return {"rows": [make_row(name, "FAIL", "; ".join(problems) + f" [{trail}]", **m.cols())]}
        return {"rows": [make_row(name, "ok", detail, **m.cols())]}
    except Exception as e:
        return {"rows": [_fail(name, e, m)]}


# --------------------------------------------------------------------------------------------------------------
# Check 2: SDPA with the packed block-causal mask (+ flash_attention_2 on sm80+)
# --------------------------------------------------------------------------------------------------------------

SDPA_OPS = (("efficient_attention", "memory-efficient"), ("flash_attention", "flash"), ("cudnn_attention", "cuDNN"),
            ("attention_math", "math"))


def sdpa_backends_used(fn) -> list[str]:
    """SDPA backends whose aten op ran inside fn() (torch profiler, CPU-side op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    return [label for op, label in SDPA_OPS if any(op in n for n in names)]


def _packed_row(model, lens, vocab, dtype_name, packed_ctx=None) -> tuple[dict, list[str], str]:
    """packed_vs_documents, then a training-mode backward through the packed row (under packed_ctx)."""
    import contextlib

    import torch

    res = packed_vs_documents(model, lens, vocab, "cuda", packed_ctx=packed_ctx)
    with (packed_ctx or contextlib.nullcontext)():
        loss = model(input_ids=res["ids"], position_ids=res["pos"], labels=res["ids"], use_cache=False).loss
        loss.backward()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    msg = (f"{dtype_name}, train mode, docs {'+'.join(map(str, lens))}: packed vs per-document max |dlogit| "
           f"{res['max_diff']:.2e} (tol {res['tol']:.1e}); without the mask {res['control_diff']:.2e}")
    problems = []
    if not res["max_diff"] <= res["tol"]:
        problems.append("packed logits differ from per-document logits")
    if not res["control_diff"] > res["tol"]:
        problems.append("control: cross-document attention is below the tolerance, the test cannot see a leak")
    if not finite or not torch.isfinite(loss):
        problems.append("non-finite loss or gradients in backward")
    return res, problems, msg


def check_sdpa_packed(a) -> dict:
    rows = []
    lens = (40, 56)
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from zerotune import hardware
        cfg = tiny_llama_config(init=0.1)  # larger weights: attention across documents moves logits visibly
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16, attn_implementation="sdpa").cuda().train()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    except Exception as e:
        return {"rows": [_fail("sdpa packed mask", e)]}

    name = "sdpa packed mask (fp16)"
    m = Measure()
    try:
        with m:
            res, problems, msg = _packed_row(model, lens, cfg.vocab_size, "fp16")
        used = sdpa_backends_used(lambda: model(input_ids=res["ids"], position_ids=res["pos"], use_cache=False))
        msg += f"; SDPA picked for the masked row: {', '.join(used) or 'unknown'}"
        if "math" in used and "memory-efficient" not in used:
            problems.append("SDPA fell back to the math kernel (S x S scores) for the packed mask; the planner "
                            "assumes a fused kernel")
        rows.append(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [msg]), **m.cols()))
    except Exception as e:
        rows.append(_fail(name, e, m))

    name = "sdpa EFFICIENT_ATTENTION forced"
    m = Measure()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with m:
            res, problems, msg = _packed_row(model, lens, cfg.vocab_size, "fp16",
                                             packed_ctx=lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
        rows.append(make_row(name, "FAIL" if problems else "ok",
                             "; ".join(problems + ["packed forward + backward ran under sdpa_kernel([EFFICIENT_"
                                                   "ATTENTION]) with the block-causal mask", msg]), **m.cols()))
    except Exception as e:
        rows.append(_fail(name, e, m))

    name = "flash_attention_2 packed (varlen)"
    cap = torch.cuda.get_device_capability(0)
    if cap < (8, 0):
        rows.append(make_row(name, "skipped", f"sm{cap[0]}{cap[1]}: FlashAttention 2 needs sm80+ (flash-attention "
                                              "#891); this card trains with sdpa"))
    elif not hardware.flash_attn_installed():
        rows.append(make_row(name, "skipped", "flash_attn not installed (pip install -e .[flash])"))
    else:
        m = Measure()
        try:
            dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            fa = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="flash_attention_2").cuda().train()
            fa.load_state_dict({k: v.to(dt) for k, v in state.items()})
            with m:
                res, problems, msg = _packed_row(fa, lens, cfg.vocab_size, str(dt).replace("torch.", ""))
            rows.append(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [msg]), **m.cols()))
        except Exception as e:
            rows.append(_fail(name, e, m))
    return {"rows": rows}


# --------------------------------------------------------------------------------------------------------------
# Check 3: Liger's real Triton kernels
# --------------------------------------------------------------------------------------------------------------

def loss_and_grads(model, ids) -> tuple[float, dict]:
    """Training-mode loss on `ids` (labels = ids) and a copy of every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-30))


def check_liger(a) -> dict:
    rows = []
    name = "liger kernels, train loss/grads (fp16)"
    m = Measure()
    try:
        if os.environ.get("TRITON_INTERPRET"):
            raise RuntimeError("TRITON_INTERPRET is set: that runs Triton's interpreter, not the GPU kernels")
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.models.llama import modeling_llama

        cfg = tiny_llama_config(vocab=32000, init=0.05)
        short, long = 512, 2048
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(2, cfg.vocab_size, (1, short), generator=g).cuda()
        ids_long = torch.randint(2, cfg.vocab_size, (1, long), generator=g).cuda()

        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16, attn_implementation="sdpa").cuda()
        loss0, grads0 = loss_and_grads(ref, ids)
        ref.eval()
        ref.zero_grad(set_to_none=True)
        unfused = Measure()  # the same eval loss unpatched: full logits, upcast to fp32 by ForCausalLMLoss
        with torch.no_grad():
            logits0 = ref(input_ids=ids, use_cache=False).logits.float()
            with unfused:
                eval_loss0 = float(ref(input_ids=ids_long, labels=ids_long, use_cache=False).loss)
        state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        del ref
        torch.cuda.empty_cache()

        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False)  # as train/worker.py load_model does, before instantiation
        patched = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16, attn_implementation="sdpa").cuda()
        patched.load_state_dict(state)
        del state
        missing = [what for what, ok in (
            ("RMSNorm", isinstance(patched.model.norm, LigerRMSNorm)),
            ("SwiGLU", isinstance(patched.model.layers[0].mlp, LigerSwiGLUMLP)),
            ("RoPE", "liger" in modeling_llama.apply_rotary_pos_emb.__module__),
            ("fused linear CE", "liger" in type(patched).forward.__module__)) if not ok]
        if missing:
            raise RuntimeError(f"Liger did not patch: {', '.join(missing)}")
        with m:
            loss1, grads1 = loss_and_grads(patched, ids)
        grad_rel = max(_rel(grads1[n], grads0[n]) for n in grads0)
        patched.eval()
        with torch.no_grad():
            logits1 = patched(input_ids=ids, use_cache=False).logits.float()
        scale = float(logits0.abs().max())
        logit_diff = float((logits1 - logits0).abs().max())
        tol = logits_tolerance(torch.float16, scale)
        problems = []
        if not abs(loss1 - loss0) <= 5e-3 * abs(loss0):
            problems.append("train loss differs")
        if not grad_rel <= 5e-2:
            problems.append("gradients differ")
        if not logit_diff <= tol:
            problems.append("eval logits differ (RoPE/RMSNorm/SwiGLU kernels)")
        del grads0, grads1, logits0, logits1  # nothing of this comparison may count in the memory row below
        patched.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        import triton
        detail = (f"seq {short}: train loss {loss1:.5f} vs unpatched {loss0:.5f}; max relative grad diff "
                  f"{grad_rel:.1e} (tol 5e-2); eval logits max diff {logit_diff:.1e} (tol {tol:.1e}); "
                  f"Triton {triton.__version__} on the GPU (TRITON_INTERPRET unset)")
        rows.append(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]), **m.cols()))
    except Exception as e:
        return {"rows": [_fail(name, e, m)]}

    name = "liger eval skip_logits (no logits)"
    m = Measure()
    try:
        patched.eval()
        with m, torch.no_grad():
            out = patched(input_ids=ids_long, labels=ids_long, use_cache=False, skip_logits=True)
        limit = long * cfg.vocab_size * 4  # one seq x vocab fp32 tensor
        eval_loss1 = float(out.loss)
        problems = []
        if out.logits is not None:
            problems.append("logits were returned")
        if not abs(eval_loss1 - eval_loss0) <= 5e-3 * abs(eval_loss0):
            problems.append("eval loss differs")
        if not m.allocated < limit:
            problems.append("max_memory_allocated reached a seq x vocab fp32 tensor")
        detail = (f"seq {long}, vocab {cfg.vocab_size}: loss {eval_loss1:.5f} vs unpatched {eval_loss0:.5f}; "
                  f"max_memory_allocated {m.allocated / 2**20:.0f} MiB (weights included) against seq x vocab x 4 B "
                  f"= {limit / 2**20:.0f} MiB; the unpatched eval loss peaked at {unfused.allocated / 2**20:.0f} MiB")
        rows.append(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]), **m.cols()))
    except Exception as e:
        rows.append(_fail(name, e, m))
    return {"rows": rows}


# --------------------------------------------------------------------------------------------------------------
# Check 4: the 1B-shaped model through the repo's ZeRO-3 training path, per phase
# --------------------------------------------------------------------------------------------------------------

def _fingerprint(engine) -> dict:
    """Sums of some 16-bit weights (local partitions: the whole tensor at world size 1), of the fp32 master
    partitions (stage3.py fp32_partitioned_groups_flat), the loss scale and the step: what a resume must restore."""
    params = dict(engine.module.named_parameters())
    pick = [n for n in params if n.endswith(("embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
                                             "layers.15.mlp.down_proj.weight", "model.norm.weight"))]
    fp = {n: float(getattr(params[n], "ds_tensor", params[n]).detach().double().sum()) for n in pick}
    master = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if master:
        fp["fp32 master"] = float(sum(t.detach().double().sum() for t in master if t.numel()))
    if engine.fp16_enabled():
        fp["loss scale"] = float(engine.optimizer.cur_scale)
    fp["step"] = int(engine.global_steps)
    return fp


def _setup_1b(a, seed: int):
    """TrainingArguments from train/args.py (created before the model, so it is built under zero.Init), Liger patched
    as train/worker.py load_model does, the model from the 1B config, the Trainer with packed rows and the repo's
    collate. Returns (trainer, clock, choice, batch plan, validation rows, config)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from zerotune import batch as batchmod
    from zerotune import hardware
    from zerotune.train.args import collate_packed, training_kwargs
    from zerotune.verify import model_dtype

    seq = a.seq[0]
    gpu = hardware.detect()
    choice = hardware.choose(gpu, "auto", "sdpa", "on")  # fp16 below sm80, bf16 from sm80; sdpa; Liger
    r = recipe_1b(seq, a.steps, plan_gpu_key(gpu.capability or (0, 0), gpu.name), out_dir=a.ckpt)
    bp = batchmod.derive(r.train.global_batch_tokens, seq, r.train.micro_batch_size, 1)  # GA 2 at world size 1
    kw = training_kwargs(r, bp, choice, gpu.capability is not None, a.steps)
    kw.update(output_dir=str(a.ckpt), save_strategy="no", report_to=[])
    _init_distributed()
    args = TrainingArguments(**kw)
    if choice.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False)
    torch.manual_seed(seed)
    config = llama32_1b_config()
    model = AutoModelForCausalLM.from_config(config, dtype=model_dtype(choice.precision), attn_implementation="sdpa")
    model.config.use_cache = False  # as train/worker.py: packed position_ids -> block-causal mask only without a cache
    if choice.liger:
        from zerotune.train.worker import gather_lm_head_with_model
        gather_lm_head_with_model(model)  # as train/worker.py load_model
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    if n_params != LLAMA32_1B_PARAMS:
        raise RuntimeError(f"the 1B config built {n_params:,} parameters, expected {LLAMA32_1B_PARAMS:,}")

    class Clock(TrainerCallback):
        """Peak stats reset once DeepSpeed's engine exists (on_train_begin follows deepspeed_init, transformers
        trainer.py _prepare_for_training); seconds per optimizer step (on_step_begin/end bracket GA micro-steps)."""

        def __init__(self):
            self.times, self.t = [], None

        def on_train_begin(self, *args, **kw):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, *args, **kw):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kw):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)

    clock = Clock()
    # exactly one epoch of a.steps optimizer steps: a resume at global_step == max_steps then trains no further step
    # (transformers trainer.py _init_training_state: epochs_trained = global_step // update steps per epoch)
    rows = packed_rows(a.steps * bp.grad_accum, seq, config.vocab_size, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                      data_collator=collate_packed, callbacks=[clock])
    val = packed_rows(N_VAL_ROWS, seq, config.vocab_size, seed=1)
    return trainer, clock, choice, bp, val, config


def _val_loss(model, val, device, liger: bool) -> tuple[float, int]:
    """zerotune.train.validation.nll_sum, the in-training validation, with Liger's fused loss (skip_logits=True: Liger's
    forward materialises the full logits in eval mode otherwise, liger_kernel/transformers/model/llama.py:113-115).
    nll_sum takes `liger` and passes skip_logits itself where the repo has that; otherwise it is added here."""
    import inspect

    from zerotune.train.validation import nll_sum

    if "liger" in inspect.signature(nll_sum).parameters:
        total, count = nll_sum(model, val, device, liger=liger)
    else:
        def forward(**kw):
            if liger:
                kw.setdefault("skip_logits", True)
            return model(**kw)
        total, count = nll_sum(forward, val, device)
    return total / max(count, 1), count


def _too_big(phase: str, expect: dict) -> str | None:
    """The reason to skip a phase the planner predicts does not fit this card (None: run it)."""
    peak = (expect.get("peaks") or {}).get(phase)
    total = expect.get("total")
    if expect.get("force") or not peak or not total or peak <= total:
        return None
    return (f"the planner predicts a {peak / GiB:.1f} GiB peak (allocator and CUDA context included) > "
            f"{total / GiB:.2f} GiB on this card (--force runs it anyway)")


def check_zero3_1b(a) -> dict:
    import torch

    seq = a.seq[0]
    tag = f"1B seq {seq}"
    expect = json.loads(a.expect or "{}")
    rows, info = [], {"saved": False}
    try:
        trainer, clock, choice, bp, val, config = _setup_1b(a, seed=1234)
        dev = trainer.args.device
    except Exception as e:
        return {"rows": [_fail(f"{tag}: setup", e)], "info": info}

    # train: optimizer steps at GA 2 through trainer.train (peak from on_train_begin: after the engine exists)
    name = f"{tag}: train"
    try:
        t0 = time.perf_counter()
        trainer.train()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        alloc, res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        engine = trainer.model_wrapped
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        step_s = statistics.median(clock.times[1:] if len(clock.times) > 1 else clock.times) if clock.times else None
        problems = []
        if trainer.state.global_step != a.steps:
            problems.append(f"stopped at step {trainer.state.global_step} of {a.steps}")
        if not losses or not all(math.isfinite(x) for x in losses):
            problems.append(f"non-finite or missing losses {losses}")
        if engine.skipped_steps >= a.steps:
            problems.append("every optimizer step was skipped (overflow)")
        scale = f", loss scale {float(engine.optimizer.cur_scale):g}" if engine.fp16_enabled() else ""
        timing = (f"median {step_s:.2f} s/step after the first, {bp.global_batch_tokens / step_s:,.0f} tokens/s"
                  if step_s else f"{wall:.1f} s in all")
        detail = (f"{choice.precision}, sdpa + packed mask, Liger {'on' if choice.liger else 'off'}, checkpointing, "
                  f"GA {bp.grad_accum}: {trainer.state.global_step} steps, {timing}; losses "
                  f"{', '.join(f'{x:.3f}' for x in losses)}; skipped steps {engine.skipped_steps}{scale}")
        rows.append(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]), allocated=alloc,
                             reserved=res, seconds=step_s))
    except Exception as e:
        rows.append(_fail(name, e))
        return {"rows": rows + [make_row(f"{tag}: {p}", "skipped", "train phase failed") for p in PHASES[1:4]],
                "info": info}

    model = trainer.model
    name = f"{tag}: validation"
    m = Measure()
    try:
        if (why := _too_big("validation", expect)):
            rows.append(make_row(name, "skipped", why))
        else:
            model.eval()
            with m, torch.no_grad():
                loss, count = _val_loss(model, val, dev, choice.liger)
            ok = math.isfinite(loss) and count > 0
            info["val_loss"] = loss  # the resumed process must measure the same (check_zero3_1b_resume)
            rows.append(make_row(name, "ok" if ok else "FAIL",
                                 f"validation.nll_sum{' with skip_logits (Liger fused loss)' if choice.liger else ''}, "
                                 f"one {seq:,}-token packed row per forward, {N_VAL_ROWS} rows: loss {loss:.4f} "
                                 f"({count:,} label tokens)", **m.cols()))
    except Exception as e:
        rows.append(_fail(name, e, m))

    name = f"{tag}: samples"
    m = Measure()
    use_cache = model.config.use_cache
    try:
        if (why := _too_big("samples", expect)):
            rows.append(make_row(name, "skipped", why))
        else:
            # the planner bounds a sample prompt by data.seq_len (planner/phases.py): the prompt is that bound
            g = torch.Generator().manual_seed(2)
            prompt = torch.randint(2, config.vocab_size, (1, seq), generator=g).to(dev)
            model.eval()
            with m, torch.no_grad():
                gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                     use_cache=True, pad_token_id=0, temperature=None, top_p=None, top_k=None,
                                     synced_gpus=False)
            new = gen.shape[1] - seq
            rows.append(make_row(name, "ok" if new == NEW_TOKENS else "FAIL",
                                 f"greedy generate, {seq:,}-token prompt (the planner's bound), KV cache: {new} new "
                                 f"tokens in {m.seconds:.2f} s", **m.cols()))
    except Exception as e:
        rows.append(_fail(name, e, m))
    finally:
        model.config.use_cache = use_cache  # as train/validation.py restores it after generate()
        model.train()

    name = f"{tag}: save"
    m = Measure()
    try:
        out_dir = Path(trainer.args.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        need = LLAMA32_1B_PARAMS * 16  # fp32 master + Adam m, v (12 B) + the 16-bit model twice (ZeRO shard, safetensors)
        free = shutil.disk_usage(out_dir).free
        if (why := _too_big("save", expect)):
            rows.append(make_row(name, "skipped", why))
        elif free < need:
            rows.append(make_row(name, "skipped", f"needs ~{need / 1e9:.0f} GB free in {out_dir}, has "
                                                  f"{free / 1e9:.0f} GB (--tmpdir elsewhere)"))
        else:
            engine = trainer.model_wrapped
            how = "Trainer._save_checkpoint (save_model: 16-bit consolidation + engine.save_checkpoint)"
            ckpt = out_dir / f"checkpoint-{trainer.state.global_step}"
            with m:
                try:
                    trainer._save_checkpoint(trainer.model, trial=None)  # what a Trainer checkpoint step runs
                except (AttributeError, TypeError) as e:  # the private method moved: DeepSpeed's own save
                    how = f"engine.save_checkpoint (Trainer._save_checkpoint unavailable: {_reason(e)})"
                    engine.save_checkpoint(str(ckpt))
                    trainer.state.save_to_json(str(ckpt / "trainer_state.json"))
            if not any(ckpt.glob("global_step*")):
                raise RuntimeError(f"no DeepSpeed checkpoint (global_step*) in {ckpt}")
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            info.update(saved=True, checkpoint=str(ckpt), fingerprint=_fingerprint(engine))
            rows.append(make_row(name, "ok", f"{how}: {size / 1e9:.1f} GB written", **m.cols()))
    except Exception as e:
        rows.append(_fail(name, e, m))
    return {"rows": rows, "info": info}


def check_zero3_1b_resume(a) -> dict:
    """A fresh process and a fresh random init (another seed), resumed through Trainer.train(resume_from_checkpoint=
    ...) as train/worker.py train_or_stop does: transformers loads it with deepspeed_load_checkpoint ->
    engine.load_checkpoint (integrations/deepspeed.py:680-700). DeepSpeed's own docstring (engine.py load_checkpoint)
    says a ZeRO-3 engine cannot load right after saving in the same engine; a fresh process is what a requeued job is."""
    import torch

    tag = f"1B seq {a.seq[0]}"
    name = f"{tag}: resume"
    expect = json.loads(a.expect or "{}")
    saved = expect.get("fingerprint") or {}
    m = Measure()
    try:
        trainer, _clock, choice, _bp, val, _config = _setup_1b(a, seed=4321)
        with m:
            trainer.train(resume_from_checkpoint=expect["checkpoint"])  # at max_steps: loads, trains no further step
        got = _fingerprint(trainer.model_wrapped)
        problems = [f"after resume {k} = {got.get(k)} != saved {v}" for k, v in saved.items()
                    if got.get(k) is None or abs(got[k] - v) > 1e-6 * max(1.0, abs(v))]
        if not saved:
            problems.append("nothing to compare: the save phase gave no fingerprint")
        # a job resumed at its last step validates with no engine forward before it (Liger reads lm_head.weight
        # directly: it must be gathered, train/worker.py gather_lm_head_with_model); same weights, same loss
        model = trainer.model
        model.eval()
        with torch.no_grad():
            loss, count = _val_loss(model, val, torch.device("cuda"), choice.liger)
        want = expect.get("val_loss")
        if not (math.isfinite(loss) and count > 0) or (want is not None and abs(loss - want) > 1e-3 * abs(want)):
            problems.append(f"validation after resume: loss {loss:.5f} ({count} tokens), before save {want}")
        detail = (f"fresh process and init, Trainer.train(resume_from_checkpoint) -> engine.load_checkpoint: step "
                  f"{got['step']}; {len(saved) - len(problems)}/{len(saved)} fingerprints equal the saved ones "
                  f"({', '.join(saved)}); time includes the engine's initialisation")
        torch.cuda.synchronize()
        return {"rows": [make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]), **m.cols())]}
    except Exception as e:
        return {"rows": [_fail(name, e, m)]}


def family_config(family: str, vocab: int = 32000):
    """A small config of another family zerotune trains, from the repo's tiny config (configs/models/), widened
    to the 8B models' head_dim 128: 8 query heads x a 4,096-token row = 32,768 rows of q-norm, where Liger's
    RMSNorm switches to its block kernel (liger_kernel/ops/rms_norm.py: n_cols <= 256 and n_rows >= 4096 * 8),
    the path Qwen3-8B's and Gemma 3's q/k norms take and a Llama's 4,096-wide norms never do."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(REPO / "configs" / "models" / f"tiny_{family}.json"))
    cfg.update(dict(vocab_size=vocab, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=128, use_cache=False, bos_token_id=0,
                    eos_token_id=1, pad_token_id=0, initializer_range=0.05 if family == "qwen3" else 0.02))
    if family == "gemma3":  # one sliding and one global layer; llama.cpp's scaling (families.llama_cpp_problems)
        cfg.update(dict(layer_types=["sliding_attention", "full_attention"], sliding_window=512,
                        query_pre_attn_scalar=128))
    return cfg


def check_liger_families(a) -> dict:
    """Liger's kernels for Qwen3 and Gemma 3, patched through families.py as the worker patches them: train loss
    and gradients and eval logits against the unpatched model, in the precision each family trains in on this
    card (Qwen3: fp16, as on a V100; Gemma 3: bf16 where the card has it, else fp32, never fp16)."""
    rows = []
    seq = 4096
    for family in ("qwen3", "gemma3"):
        m = Measure()
        name = f"liger {family}: train loss/grads, eval logits"
        try:
            if os.environ.get("TRITON_INTERPRET"):
                raise RuntimeError("TRITON_INTERPRET is set: that runs Triton's interpreter, not the GPU kernels")
            import torch
            from transformers import AutoModelForCausalLM

            from zerotune import families

            fam = families.FAMILIES[family]
            if family == "qwen3":
                dtype = torch.float16
            else:
                dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
            name = f"{name} ({str(dtype).removeprefix('torch.')})"
            cfg = family_config(family)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(2, cfg.vocab_size, (1, seq), generator=g).cuda()

            torch.manual_seed(0)
            ref = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").cuda()
            loss0, grads0 = loss_and_grads(ref, ids)
            ref.eval()
            with torch.no_grad():
                logits0 = ref(input_ids=ids[:, :512], use_cache=False).logits.float()
            state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
            # the same weights in fp32: the yardstick both 16-bit runs are measured against (in fp16 the
            # unpatched model's own gradients are ~5% off in places, so patched vs unpatched alone misleads)
            _, grads32 = loss_and_grads(ref.float(), ids)
            del ref
            torch.cuda.empty_cache()

            families.apply_liger(fam)  # before instantiation, as train/worker.py does
            patched = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").cuda()
            patched.load_state_dict(state)
            del state
            attn, mlp = patched.model.layers[0].self_attn, patched.model.layers[0].mlp
            missing = [what for what, mod in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm),
                                              ("final norm", patched.model.norm), ("MLP", mlp))
                       if "liger" not in type(mod).__module__]
            if "liger" not in type(patched).forward.__module__:
                missing.append("fused linear CE")
            if missing:
                raise RuntimeError(f"Liger did not patch: {', '.join(missing)}")
            with m:
                loss1, grads1 = loss_and_grads(patched, ids)
            rels = {n: _rel(grads1[n], grads0[n]) for n in grads0}
            worst = max(rels, key=rels.get)
            grad_rel = rels[worst]
            # Liger's error against fp32, per tensor, over the unpatched model's own (floor 1e-3: fp32 itself)
            excess = {n: _rel(grads1[n], grads32[n]) / max(_rel(grads0[n], grads32[n]), 1e-3) for n in grads0}
            worst_x = max(excess, key=excess.get)
            finite = all(bool(torch.isfinite(v).all()) for v in grads1.values())
            patched.eval()
            with torch.no_grad():
                logits1 = patched(input_ids=ids[:, :512], use_cache=False).logits.float()
            tol = logits_tolerance(dtype, float(logits0.abs().max())) if dtype != torch.float32 else 1e-3
            logit_diff = float((logits1 - logits0).abs().max())
            problems = []
            if not finite:
                problems.append("non-finite gradients")
            if not abs(loss1 - loss0) <= 5e-3 * abs(loss0):
                problems.append("train loss differs")
            if not excess[worst_x] <= 2.0:
                problems.append("gradients further from fp32 than the unpatched model's")
            if not logit_diff <= tol:
                problems.append("eval logits differ")
            detail = (f"seq {seq} (q-norm rows {cfg.num_attention_heads * seq:,}: Liger's block RMSNorm), head_dim "
                      f"{cfg.head_dim}: train loss {loss1:.5f} vs unpatched {loss0:.5f}; max relative grad diff "
                      f"{grad_rel:.1e} ({worst}); against fp32, Liger's gradient error is at most "
                      f"{excess[worst_x]:.2f}x the unpatched model's ({worst_x}; tol 2x); eval logits max diff {logit_diff:.1e} "
                      f"(tol {tol:.1e}); patched via families.apply_liger ({fam.liger})")
            rows.append(make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]), **m.cols()))
            del patched, grads0, grads1, grads32, logits0, logits1
            torch.cuda.empty_cache()
        except Exception as e:
            rows.append(_fail(name, e, m))
    return {"rows": rows}


# --------------------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------------------

WORKER_FNS = {"env": worker_env, "fp16_loss_scale": check_fp16_loss_scale, "sdpa_packed": check_sdpa_packed,
              "liger": check_liger, "liger_families": check_liger_families, "zero3_1b": check_zero3_1b,
              "zero3_1b_resume": check_zero3_1b_resume}


def worker_main(a) -> int:
    try:
        payload = WORKER_FNS[a.worker](a)
    except Exception as e:  # the check functions catch their own; this is the last net
        payload = {"rows": [_fail(a.worker, e)]}
    sys.stdout.flush()
    print(ROW_MARK + json.dumps(payload), flush=True)
    return 0


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cuda", PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # every model here is built from a local config
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def crash_reason(rc: int, stderr: str) -> str:
    """One line for a worker that died without a payload: the last error-looking line of its stderr."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    err = next((x for x in reversed(lines) if "Error" in x or "error:" in x or "Killed" in x), lines[-1] if lines else "")
    sig = f" (signal {-rc}{': killed, host out of memory?' if rc == -9 else ''})" if rc < 0 else ""
    return f"worker exited {rc}{sig} without a result: {err[:300]}".rstrip(": ")


def run_worker(name: str, a, extra: list[str], label: str, log_dir: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--steps", str(a.steps), *extra]
    log = log_dir / f"{label}.log"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=_child_env(), cwd=str(REPO))
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
        return {"rows": [make_row(label, "FAIL", f"timed out after {a.timeout} s (--timeout); log {log}")]}
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}")
    payload = next((json.loads(x[len(ROW_MARK):]) for x in reversed(out.splitlines()) if x.startswith(ROW_MARK)), None)
    if payload is None:
        return {"rows": [make_row(label, "FAIL", crash_reason(rc, err) + f"; log {log}")]}
    return payload


def run_1b(a, seq: int, info: dict, log_dir: Path, emit) -> list[dict]:
    """The 1B check at one sequence length: the planner's prediction here, train..save in one worker process, resume
    in a second (fresh) one; the checkpoint lives in a temp dir removed afterwards."""
    tag = f"1B seq {seq}"
    rows = []
    try:
        pred = predict_1b(seq, tuple(info["capability"]), info["name"], a.steps)
        note = f"plan gpu {pred['plan_gpu']}" + ("" if pred["has_phase_model"] else
                                                 "; the planner has no per-phase model: train predicted only")
    except Exception as e:
        traceback.print_exc()
        pred, note = None, f"no prediction: {_reason(e)}"

    def predicted(row, phase):
        if pred:
            row["predicted_allocated_bytes"], row["predicted_reserved_bytes"], _ = pred["phases"][phase]
        return row

    peaks = {ph: v[2] for ph, v in pred["phases"].items()} if pred else {}
    expect = {"peaks": peaks, "total": info["total_memory"], "force": a.force}
    why = _too_big("train", expect)
    if why:
        return [emit(predicted(make_row(f"{tag}: {p}", "skipped", f"{why}; {note}" if p == "train" else why), p))
                for p in PHASES]

    if a.tmpdir:
        Path(a.tmpdir).mkdir(parents=True, exist_ok=True)  # a named --tmpdir need not exist yet
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_1b_", dir=a.tmpdir))
    try:
        payload = run_worker("zero3_1b", a, ["--seq", str(seq), "--ckpt", str(tmp / "trainer"),
                                             "--expect", json.dumps(expect)], f"zero3_1b_seq{seq}", log_dir)
        seen = set()
        for r in payload["rows"]:
            phase = r["check"].split(": ", 1)[-1]
            seen.add(phase)
            if phase == "train":
                r["detail"] += f"; {note}"
            rows.append(emit(predicted(r, phase) if phase in PHASES else r))
        if not seen & set(PHASES):  # the worker died before any phase: name them
            rows += [emit(predicted(make_row(f"{tag}: {p}", "skipped", "the 1B worker failed (row above)"), p))
                     for p in PHASES[:4]]
        winfo = payload.get("info") or {}
        name = f"{tag}: resume"
        if not winfo.get("saved"):
            rows.append(emit(predicted(make_row(name, "skipped", "nothing was saved (save row)"), "resume")))
        elif (why := _too_big("resume", expect)):
            rows.append(emit(predicted(make_row(name, "skipped", why), "resume")))
        else:
            payload = run_worker("zero3_1b_resume", a, [
                "--seq", str(seq), "--ckpt", str(tmp / "trainer"),
                "--expect", json.dumps({**expect, "checkpoint": winfo["checkpoint"],
                                        "fingerprint": winfo.get("fingerprint"), "val_loss": winfo.get("val_loss")})],
                f"zero3_1b_resume_seq{seq}", log_dir)
            for r in payload["rows"]:
                r["check"] = name
                rows.append(emit(predicted(r, "resume")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)

    import torch

    if not torch.cuda.is_available():
        print(NO_GPU_LINE.format(seqs=", ".join(map(str, a.seq))), flush=True)
        return 0

    out = a.out if a.out.is_absolute() else Path.cwd() / a.out
    log_dir = out.parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = run_worker("env", a, [], "env", log_dir)
    info = env.get("info")
    if not info:
        print("gpu_check: could not query the GPU: " + (env["rows"][0]["detail"] if env.get("rows") else "?"))
        return 1
    for line in header_lines(info):
        print(line, flush=True)

    rows = []

    def emit(row):
        print(f"gpu_check: {row['status']:<7} {row['check']}: {row['detail']}", flush=True)
        return row

    for check in a.checks:
        if check == "zero3_1b":
            for seq in a.seq:
                rows += run_1b(a, seq, info, log_dir, emit)
        else:
            rows += [emit(r) for r in run_worker(check, a, [], check, log_dir)["rows"]]

    failed = sum(r["status"] == "FAIL" for r in rows)
    print()
    print(format_table(rows))
    out.write_text(json.dumps({"device": info, "args": {"seq": a.seq, "checks": a.checks, "steps": a.steps,
                                                        "force": a.force},
                               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows, "failed": failed},
                              indent=2) + "\n")
    print(f"\ngpu_check: {len(rows)} rows, {failed} failed; JSON {out}; logs {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
