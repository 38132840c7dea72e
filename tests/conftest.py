"""Shared fixtures: the real Llama-3.1 tokenizer (fetched by `make setup`) and a tiny random model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

REPO = Path(__file__).resolve().parents[1]
# third-party lines zerotune silences at their source (src/zerotune/quiet.py, train/worker.py): none may come back
NOISE = ["Traceback", "examples/s]", "is deprecated", "Setting accelerator to CPU", "Gradient accumulation steps mismatch",
         "n_ctx_train (0)", "built successfully", "OMP_NUM_THREADS", "gemm_4bit_forward", "{'loss'", "'train_runtime'",
         "Writing model shards", "clean_up_tokenization_spaces"]
TOKENIZER_DIR = REPO / "assets" / "tokenizer" / "llama3_1"
TINY_CONFIG = REPO / "configs" / "models" / "tiny_llama31.json"


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.fail(f"{TOKENIZER_DIR} missing: run `make setup`")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A random-init tiny Llama-3.1-architecture model with the real tokenizer, saved like a trained one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_CONFIG), dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_model_dir) -> Path:
    """tiny_model_dir converted to Q8_0 by llama.cpp's own converter."""
    from zerotune.quantize import run_converter

    out = tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"
    run_converter(tiny_model_dir, "q8_0", out)
    return out


def tiny_random_model(vocab: int = 512):
    """tiny_llama31's architecture with a small vocabulary, random weights (seed 0), fp32: the fused losses' tests
    compare it against the formulas on its full logits (test_preference.py, test_grpo.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(TINY_CONFIG)
    cfg.vocab_size = vocab
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def zt(*args: str, timeout: int = 1200, env: dict | None = None):
    """`python -m zerotune ARGS` as a user runs it, from the repo root; fails the test with the log tail.
    env: variables added to this process's environment (a fault injection, faults.py)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "zerotune", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise AssertionError(f"zerotune {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def _zt(*args: str, timeout: int = 1200, env: dict | None = None) -> str:
    proc = zt(*args, timeout=timeout, env=env)
    return proc.stdout + proc.stderr


def finetune_on(procs: int, recipe: str, out: Path, *overrides: str, **env: str) -> tuple[int, str]:
    """`zerotune finetune RECIPE` on `procs` CPU processes into `out`, as a (re)submission on another number of GPUs
    would run it: (exit code, log), the failure left to the caller. env: variables added (ZEROTUNE_DEADLINE, ...)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "zerotune", "finetune", recipe, f"output_dir={out}", *overrides,
                           f"train.cpu_procs={procs}"], cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, **env})
    return proc.returncode, proc.stdout + proc.stderr


def read_metrics(out: Path) -> list[dict]:
    """The per-step training rows of a run folder (validation rows have no loss)."""
    import json

    return [r for r in map(json.loads, (out / "train" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def start_train(out: Path, log: Path, *extra: str, recipe: str = "tiny"):
    """`zerotune finetune` in the background (to be signalled or killed mid-run), its output in `log`."""
    import subprocess
    import sys

    f = open(log, "w+")  # a file, not a pipe: a full pipe would block the workers
    return subprocess.Popen([sys.executable, "-m", "zerotune", "finetune", recipe, f"output_dir={out}", *extra],
                            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True)


def workers_of(out: Path) -> str:
    """pkill -f's pattern for a run's training ranks (not its launcher or torchrun): what slurm/finetune.sbatch's
    trap signals. torchrun starts each as `python -u -m zerotune.train worker RUN_DIR`."""
    return f"python[^ ]* -u -m zerotune.train worker {out}$"


def wait_for_step(proc, out: Path, step: int, committed: int | None = None) -> None:
    """Until the run has logged `step` (and committed checkpoint-`committed`); fails if it ends first."""
    import time

    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        rows = read_metrics(out) if (out / "train" / "metrics.jsonl").exists() else []
        marker = out / "checkpoints" / f"checkpoint-{committed}" / "zerotune_commit.json"
        if rows and rows[-1]["step"] >= step and (committed is None or marker.exists()):
            return
        time.sleep(0.3)
    raise AssertionError(f"run ended or timed out before step {step} (exit {proc.poll()})")


TINY_STEPS = ["train.logging_steps=1", "train.max_steps=20"]
# the resume tests' run: 10 steps, a committed checkpoint every 2, 2 kept (test_resume.py, test_slurm_cluster.py)
RESUME_STEPS = 10
RESUME_COMMON = ["train.logging_steps=1", f"train.max_steps={RESUME_STEPS}", "train.save_steps=2",
                 "train.save_total_limit=2"]


@pytest.fixture(scope="session")
def tiny_reference_10(tmp_path_factory):
    """tiny, RESUME_COMMON uninterrupted on 2 ZeRO-3 CPU ranks: the run every stopped-and-resumed run must equal,
    locally (test_resume.py) and through sbatch (test_slurm_cluster.py). Shared: one training instead of two."""
    out = tmp_path_factory.mktemp("reference")
    _zt("data", "tiny", f"output_dir={out}")
    _zt("finetune", "tiny", f"output_dir={out}", *RESUME_COMMON)
    return out


# tiny_dpo's runs in tests/test_preference.py: 6 steps, the first already moving the weights (no warmup), validation
# on the held-out pairs at step 3 and at the end
DPO_COMMON = ["train.max_steps=6", "train.warmup_ratio=0", "train.eval_steps=3", "train.logging_steps=1"]


@pytest.fixture(scope="session")
def tiny_dpo_reference(tmp_path_factory):
    """tiny_dpo, DPO_COMMON uninterrupted on 2 ZeRO-3 CPU ranks: what a run on other world sizes must equal."""
    out = tmp_path_factory.mktemp("dpo_reference")
    _zt("data", "tiny_dpo", f"output_dir={out}")
    _zt("finetune", "tiny_dpo", f"output_dir={out}", *DPO_COMMON)
    return out


@pytest.fixture(scope="session")
def tiny_trained_20(tmp_path_factory):
    """tiny, 20 steps on 2 ZeRO-3 CPU ranks, validation only at the end: (run folder, log). Shared so that
    the runs compared with it (evaluation during training) don't retrain it. Its samples gather per generated
    token (the fault that finds no room to gather the whole model, as one 8xV100 node at 8B), tiny_eval_run's
    gather the model once: the same final weights, so the same answers (test_eval_training.py)."""
    out = tmp_path_factory.mktemp("tiny_run")
    _zt("data", "tiny", f"output_dir={out}")
    return out, _zt("finetune", "tiny", f"output_dir={out}", *TINY_STEPS,
                    env={"ZEROTUNE_FAULT_NO_ROOM_TO_GATHER": "1"})


@pytest.fixture(scope="session")
def tiny_eval_run(tmp_path_factory):
    """The same run (same data, same deterministic init) with validation + samples every 10 steps, then
    quantized to Q8_0: (run folder, log). Independent of tiny_trained_20, so `zerotune eval` tests alone
    train once."""
    out = tmp_path_factory.mktemp("tiny_eval_run")
    _zt("data", "tiny", f"output_dir={out}")
    log = _zt("finetune", "tiny", f"output_dir={out}", *TINY_STEPS, "train.eval_steps=10")
    _zt("quantize", "tiny", f"output_dir={out}")
    return out, log


def allocation_events(fn):
    """Run fn under torch.profiler with memory profiling: (fn's result, its allocation and free events in time
    order, an allocation before a free at the same instant). Exact to the byte on CPU (the allocator's own
    records); what the phase-memory tests replay into live-bytes curves."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation:
            allocs.append(ev)
    allocs.sort(key=lambda ev: (ev.start_time_ns, ev.extra_fields.alloc_size < 0))
    return result, allocs
