"""Committed checkpoints: only a checkpoint every rank finished writing counts.

HF Trainer writes straight into checkpoint-N and resumes from the highest
number without checking it is complete; DeepSpeed may write `latest` before
every rank is done. After each save, all ranks report whether their files are
there, and rank 0 commits a marker last (temp file, fsync, rename).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from transformers import TrainerCallback

from . import manifest as mf

MARKER = "zerotune_commit.json"


def _step(p: Path) -> int:
    m = re.fullmatch(r"checkpoint-(\d+)", p.name)
    return int(m.group(1)) if m else -1


def committed(ckpt_root: Path) -> list[Path]:
    root = Path(ckpt_root)
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if _step(p) >= 0 and (p / MARKER).exists()), key=_step)


def last_committed(ckpt_root: Path) -> Path | None:
    root = Path(ckpt_root)
    good = committed(root)
    if root.exists():
        partial = [p for p in root.iterdir() if _step(p) >= 0 and not (p / MARKER).exists()
                   and (not good or _step(p) > _step(good[-1]))]
        for p in partial:
            print(f"checkpoint: ignoring {p.name}: never committed (interrupted while saving)", flush=True)
    return good[-1] if good else None


class CommitCheckpoints(TrainerCallback):
    def on_save(self, args, state, control, **kw):
        import torch
        import torch.distributed as dist

        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        ok = torch.tensor(1.0 if ckpt.exists() and any(ckpt.iterdir()) else 0.0)
        if dist.is_initialized():
            ok = ok.to(args.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            raise RuntimeError(f"checkpoint {ckpt} is incomplete on at least one rank; not committing it. "
                               "The previous committed checkpoint is intact.")
        if state.is_world_process_zero:
            mf.write(ckpt / MARKER, {"step": state.global_step, "world_size": args.world_size})
            os.sync()
        if dist.is_initialized():
            dist.barrier()
        return control


STOPPED_FILE = "stopped.json"
REQUEUE_EXIT = 75  # EX_TEMPFAIL: stopped on a signal with a committed checkpoint; run again to resume


class StopOnSignal(TrainerCallback):
    """SIGUSR1 (SLURM's time-limit warning, forwarded by slurm/finetune.sbatch) or SIGTERM: checkpoint at the
    next optimizer-step boundary and stop. The flag is reduced across ranks every step so all ranks stop at
    the same step; a rank entering the ZeRO-3 save alone would hang the others."""

    def __init__(self):
        import signal

        self.requested: str | None = None
        self.stopped_at: int | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        import signal

        self.requested = signal.Signals(signum).name

    def on_step_end(self, args, state, control, **kw):
        import torch
        import torch.distributed as dist

        flag = torch.tensor(1.0 if self.requested else 0.0)
        if dist.is_initialized():
            flag = flag.to(args.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            if state.is_world_process_zero:
                print(f"train: {self.requested or 'a signal on another rank'} received: checkpointing at step "
                      f"{state.global_step} and stopping", flush=True)
        return control
