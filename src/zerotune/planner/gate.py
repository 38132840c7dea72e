"""Refuse a launch the plan says will not fit, before any worker starts: every phase's memory, the global batch,
and the disk under output_dir. Both take the launch's one Plan (compute.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config import Recipe
from .memory import GiB
from .records import Plan
from .report import suggestion
from .target import PlanError


def preflight(p: Plan, r: Recipe) -> None:
    """Raise PlanError if any phase of the job is predicted not to fit its target; skipped for CPU targets."""
    if r.plan.gpu == "cpu":
        return
    rb, m = p.recipe_batch, p.memory
    if rb.batch_error:
        raise PlanError(rb.batch_error)
    problems = []
    if not rb.fits:
        rec = p.recommended
        fix = (f"use data.seq_len={rec.seq_len} train.micro_batch_size={rec.micro_batch_size}"
               + (f" train.sequence_parallel={rec.sequence_parallel}" if rec.sequence_parallel != rb.sequence_parallel
                  else "") if rec
               else "; ".join(suggestion(s) for s in p.suggestions))
        problems.append(f"train_step: predicted peak {m.peak_bytes / GiB:.1f} GiB per GPU exceeds "
                        f"{m.capacity_bytes / GiB:.2f} GiB on {p.cluster.gpu_name} at seq_len {rb.seq_len} "
                        f"x micro-batch {rb.micro_batch_size}. Suggested: {fix}")
    for name, ph in p.phases.items():
        if name != "train_step" and ph.runs and not ph.fits:
            where = "per GPU" if ph.limit == "gpu" else "host RAM per node (plan.cpu_ram_gb)"
            problems.append(f"{name}: {ph.peak_bytes / GiB:.1f} GiB of {ph.capacity_bytes / GiB:.2f} {where} "
                            f"({ph.what}): {ph.fix}")
    if problems:
        raise PlanError(" | ".join(problems) + f". (`make plan RECIPE={r.name}` shows the breakdown; "
                        "--skip-preflight skips this check.)")


def disk_preflight(p: Plan, r: Recipe, where) -> None:
    """Raise PlanError if output_dir's file system cannot hold what the run still has to write at its worst
    event: better now than a failed save hours into the run (which would still leave the previous checkpoint
    intact). The run's own committed checkpoints are counted as already used (planner/disk.py), so a requeued
    run asks only for the room its next events need."""
    d = p.disk
    where = Path(where)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < d.needed_free_bytes:
        h = d.held
        mine = (f"its {h.checkpoints} committed checkpoint(s) ({h.checkpoint_bytes / GiB:.1f} GiB) "
                "already counted as used" if h.checkpoints else "it holds no checkpoint yet")
        raise PlanError(f"{where} has {free / GiB:.1f} GiB free; this run needs {d.needed_free_bytes / GiB:.1f} GiB "
                        f"more at its {d.needed_at} ({mine}; checkpoints of {d.checkpoint_bytes / GiB:.1f} GiB, "
                        f"train.save_total_limit={r.train.save_total_limit}). Free space, lower "
                        "train.save_total_limit, or set output_dir elsewhere (--skip-preflight skips this check).")
