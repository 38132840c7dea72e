"""Committed checkpoints: only a checkpoint every rank finished writing, with finite weights, counts.

HF Trainer writes straight into checkpoint-N and resumes from the highest
number without checking it is complete; DeepSpeed may write `latest` before
every rank is done; HF's rotation deletes old checkpoints *before* the new one
is known to be good. So: after each save, all ranks report whether their files
are there and their weight shards are finite; rank 0 then commits a marker last
(temp file, fsync, rename) that lists every file with its size, and only then
rotates old checkpoints. Resume takes the newest committed checkpoint whose
files still match the marker, and says why it skipped any newer one.

The marker is one record, CommitMarker, written here and read through its `read` by every reader: resume
(problem, here), the world-size change (reshard.py: the batch and grad-accum it was trained with), the
worker's setup message (train/worker.py) and the deadline check (train/callbacks.py: how long the save took).
When training stops (a signal, the job's deadline, nothing left to train) is stopping.py's.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from . import manifest as mf

MARKER = "zerotune_commit.json"


@dataclass
class CommitMarker:
    """checkpoint-N/zerotune_commit.json, written last by rank 0 once every rank saved finite weights. Fields
    added since the first markers are optional: a checkpoint committed by an older zerotune still resumes."""
    step: int
    world_size: int | None = None  # the ranks that wrote it
    # the batch it was trained with (batch.BatchPlan.record): a resume must keep global_batch_tokens
    # (reshard.refuse_other_batch); grad_accum at world_size rescales fp16's loss scale at another world size
    global_batch_tokens: int | None = None
    seq_len: int | None = None
    micro_batch_size: int | None = None
    grad_accum: int | None = None
    sequence_parallel: int | None = None  # ranks that shared each row: resuming at another degree is allowed
    save_s: float | None = None  # how long its save took: the resumed run's deadline check knows it before saving
    files: dict[str, int] = field(default_factory=dict)  # every file but the marker, and its size: problem()

    def write(self, ckpt: Path) -> None:
        mf.write(Path(ckpt) / MARKER, asdict(self))

    @classmethod
    def read(cls, ckpt: Path) -> CommitMarker | None:
        """The marker of checkpoint folder `ckpt`; None when it was never committed. Keys this version does not
        know (a marker from a newer zerotune) are left out rather than refused: resume reads what it needs."""
        d = mf.read(Path(ckpt) / MARKER)
        if d is None:
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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
    marker = CommitMarker.read(ckpt)
    if marker is None:
        return "never committed (interrupted while saving)"
    for rel, size in marker.files.items():
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


def saved_world_size(ckpt: Path) -> int | None:
    """How many data-parallel ranks wrote this checkpoint's ZeRO optimizer state: DeepSpeed writes one
    `[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt` per rank (deepspeed/runtime/engine.py
    _get_rank_zero_ckpt_name). None when the checkpoint has no ZeRO shards (QLoRA without DeepSpeed: its
    optimizer.pt is whole, so any world size resumes it). Another world size resumes through reshard.py."""
    ranks = {m.group(1) for f in Path(ckpt).glob("global_step*/*zero_pp_rank_*_optim_states.pt")
             if (m := re.search(r"zero_pp_rank_(\d+)_", f.name))}
    return len(ranks) or None


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


def describe_failure(exc: BaseException, ckpt_root: Path, saving_step: int | None, say_error: bool = True) -> str:
    """What a failed run left behind, so the user knows nothing committed was lost. say_error False: the error
    itself is said elsewhere (a user error's one line)."""
    good = last_committed(ckpt_root, quiet=True)
    msg = f"finetune: stopped by {type(exc).__name__}: {exc}\n" if say_error else ""
    if saving_step is not None:
        where = Path(ckpt_root) if Path(ckpt_root).exists() else Path(ckpt_root).parent
        msg += (f"finetune: writing checkpoint-{saving_step} failed ({shutil.disk_usage(where).free / 2**30:.1f} GiB "
                f"free under {where}); it is not committed and will be ignored. If the disk is full, free space "
                "(or lower train.save_total_limit), then rerun the same command.\n")
    return msg + (f"finetune: last committed checkpoint: {good} (intact; rerunning the same command resumes from it)"
                  if good else "finetune: no committed checkpoint yet; a rerun starts from the beginning")
