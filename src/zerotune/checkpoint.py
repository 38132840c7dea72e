"""Committed checkpoints: only a checkpoint every rank finished writing, with finite weights, counts.

HF Trainer writes straight into checkpoint-N and resumes from the highest
number without checking it is complete; DeepSpeed may write `latest` before
every rank is done; HF's rotation deletes old checkpoints *before* the new one
is known to be good. So: after each save, all ranks report whether their files
are there and their weight shards are finite; rank 0 then commits a marker last
(temp file, fsync, rename) that lists every file with its size, and only then
rotates old checkpoints. Resume takes the newest committed checkpoint whose
files still match the marker, and says why it skipped any newer one.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from transformers import TrainerCallback

from . import manifest as mf

MARKER = "zerotune_commit.json"


class NonFiniteWeightsError(RuntimeError):
    pass


def step_of(p: Path) -> int:
    """The step of a checkpoint-N folder; -1 for anything else."""
    m = re.fullmatch(r"checkpoint-(\d+)", p.name)
    return int(m.group(1)) if m else -1


def _all(root: Path) -> list[Path]:
    root = Path(root)
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) >= 0), key=step_of) if root.exists() else []


def file_sizes(ckpt: Path) -> dict[str, int]:
    return {str(f.relative_to(ckpt)): f.stat().st_size for f in sorted(Path(ckpt).rglob("*"))
            if f.is_file() and f.name != MARKER}


def problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be resumed from, or None if its files match what was committed."""
    marker = mf.read(Path(ckpt) / MARKER)
    if marker is None:
        return "never committed (interrupted while saving)"
    for rel, size in (marker.get("files") or {}).items():
        f = Path(ckpt) / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} is {f.stat().st_size:,} bytes but was committed with {size:,} (truncated or overwritten)"
    return None


def committed(ckpt_root: Path) -> list[Path]:
    return [p for p in _all(ckpt_root) if (p / MARKER).exists()]


def last_committed(ckpt_root: Path, quiet: bool = False) -> Path | None:
    """The newest checkpoint that was committed and is still intact; says why newer ones were skipped."""
    for p in reversed(_all(ckpt_root)):
        why = problem(p)
        if why is None:
            return p
        if not quiet:
            print(f"checkpoint: skipping {p.name}: {why}; trying the previous one", flush=True)
    return None


def discard_after(ckpt_root: Path, resume: Path | None) -> list[str]:
    """Remove checkpoint folders newer than the resume point: they are partial or damaged (last_committed
    skipped them), and the resumed run would write into the same names, mixing stale files with new ones."""
    limit = step_of(resume) if resume else -1
    gone = []
    for p in _all(ckpt_root):
        if step_of(p) > limit:
            shutil.rmtree(p)
            gone.append(p.name)
    if gone:
        print(f"checkpoint: removed unusable {', '.join(gone)} (newer than the resume point, not intact)", flush=True)
    return gone


def rotate(ckpt_root: Path, keep: int | None) -> list[str]:
    """Keep the newest `keep` committed checkpoints; delete older ones and stale uncommitted folders.
    Runs only after a commit, so the newest committed checkpoint is never a candidate."""
    good = committed(ckpt_root)
    if not good:
        return []
    newest = step_of(good[-1])
    doomed = [p for p in _all(ckpt_root) if step_of(p) < newest and not (p / MARKER).exists()]
    if keep and keep > 0:
        doomed += good[:-keep]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return sorted(p.name for p in doomed)


def local_weights_finite(model) -> bool:
    """This rank's weights are finite: under ZeRO-3 each rank checks its own partition (ds_tensor)."""
    import torch

    for p in model.parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        if t.numel() and not bool(torch.isfinite(t).all()):
            return False
    return True


class CommitCheckpoints(TrainerCallback):
    """Replaces HF's save_total_limit rotation (give the Trainer save_total_limit=None)."""

    def __init__(self, keep: int | None):
        self.keep = keep
        self.saving: int | None = None  # the step being saved, for the error message if writing fails

    def on_step_end(self, args, state, control, **kw):
        self.saving = state.global_step if control.should_save else None
        return control

    def on_save(self, args, state, control, model=None, **kw):
        import torch
        import torch.distributed as dist

        self.saving = None  # the files are written; what can fail now is the commit check
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        ok = torch.tensor([1.0 if ckpt.exists() and any(ckpt.iterdir()) else 0.0,
                           1.0 if model is None or local_weights_finite(model) else 0.0])
        if dist.is_initialized():
            ok = ok.to(args.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        previous = last_committed(ckpt.parent, quiet=True)
        kept = f"the last committed checkpoint ({previous}) is intact" if previous else "no earlier checkpoint was committed"
        if ok[1].item() < 1:
            raise NonFiniteWeightsError(f"{ckpt} holds non-finite (NaN/inf) weights at step {state.global_step}: "
                                        f"not committing it; {kept}. Lower train.lr or check the data.")
        if ok[0].item() < 1:
            raise RuntimeError(f"checkpoint {ckpt} is incomplete on at least one rank; not committing it; {kept}.")
        if state.is_world_process_zero:
            os.sync()  # the sizes recorded must be what is on disk
            mf.write(ckpt / MARKER, {"step": state.global_step, "world_size": args.world_size,
                                     "files": file_sizes(ckpt)})
            os.sync()
            gone = rotate(ckpt.parent, self.keep)
            print(f"checkpoint: committed {ckpt.name}" + (f"; removed {', '.join(gone)}" if gone else ""), flush=True)
        if dist.is_initialized():
            dist.barrier()
        return control


def describe_failure(exc: BaseException, ckpt_root: Path, saving_step: int | None) -> str:
    """What a failed run left behind, so the user knows nothing committed was lost."""
    good = last_committed(ckpt_root, quiet=True)
    msg = f"train: stopped by {type(exc).__name__}: {exc}\n"
    if saving_step is not None:
        where = Path(ckpt_root) if Path(ckpt_root).exists() else Path(ckpt_root).parent
        msg += (f"train: writing checkpoint-{saving_step} failed ({shutil.disk_usage(where).free / 2**30:.1f} GiB "
                f"free under {where}); it is not committed and will be ignored. If the disk is full, free space "
                "(or lower train.save_total_limit), then rerun the same command.\n")
    return msg + (f"train: last committed checkpoint: {good} (intact; rerunning the same command resumes from it)"
                  if good else "train: no committed checkpoint yet; a rerun starts from the beginning")


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
