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


def saved_world_size(ckpt: Path) -> int | None:
    """How many data-parallel ranks wrote this checkpoint's ZeRO optimizer state: DeepSpeed writes one
    `[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt` per rank (deepspeed/runtime/engine.py
    _get_rank_zero_ckpt_name). None when the checkpoint has no ZeRO shards (QLoRA without DeepSpeed: its
    optimizer.pt is whole, so any world size resumes it). Another world size resumes through universal.py."""
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


class CommitCheckpoints(TrainerCallback):
    """Replaces HF's save_total_limit rotation (give the Trainer save_total_limit=None).

    batch: the run's batch arithmetic, written into each marker: a resume at another world size keeps the global
    batch in tokens and re-derives grad-accum, and checks against it (universal.check)."""

    def __init__(self, keep: int | None, batch: dict | None = None):
        self.keep = keep
        self.batch = batch or {}
        self.saving: int | None = None  # the step being saved, for the error message if writing fails
        self.save_t0 = 0.0

    def on_step_end(self, args, state, control, **kw):
        import time

        self.saving = state.global_step if control.should_save else None
        self.save_t0 = time.time()
        return control

    def on_save(self, args, state, control, model=None, **kw):
        import torch
        import torch.distributed as dist

        from .safety import check_weights, local_weights_finite

        self.saving = None  # the files are written; what can fail now is the commit check
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        ok = torch.tensor([1.0 if ckpt.exists() and any(ckpt.iterdir()) else 0.0,
                           1.0 if model is None or local_weights_finite(model) else 0.0])
        if dist.is_initialized():
            ok = ok.to(args.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        previous = last_committed(ckpt.parent, quiet=True)
        kept = f"the last committed checkpoint ({previous}) is intact" if previous else "no earlier checkpoint was committed"
        check_weights(ok[1].item() >= 1, ckpt, state.global_step, kept)  # safety.py: never commit NaN/inf weights
        if ok[0].item() < 1:
            raise RuntimeError(f"checkpoint {ckpt} is incomplete on at least one rank; not committing it; {kept}.")
        if state.is_world_process_zero:
            os.sync()  # the sizes recorded must be what is on disk
            import time

            # save_s: how long this save took, so a resumed run's deadline check knows it before it saves
            mf.write(ckpt / MARKER, {"step": state.global_step, "world_size": args.world_size, **self.batch,
                                     "save_s": round(time.time() - self.save_t0, 3), "files": file_sizes(ckpt)})
            os.sync()
            gone = rotate(ckpt.parent, self.keep)
            print(f"checkpoint: committed {ckpt.name}" + (f"; removed {', '.join(gone)}" if gone else ""), flush=True)
        if dist.is_initialized():
            dist.barrier()
        return control


def describe_failure(exc: BaseException, ckpt_root: Path, saving_step: int | None) -> str:
    """What a failed run left behind, so the user knows nothing committed was lost."""
    good = last_committed(ckpt_root, quiet=True)
    msg = f"finetune: stopped by {type(exc).__name__}: {exc}\n"
    if saving_step is not None:
        where = Path(ckpt_root) if Path(ckpt_root).exists() else Path(ckpt_root).parent
        msg += (f"finetune: writing checkpoint-{saving_step} failed ({shutil.disk_usage(where).free / 2**30:.1f} GiB "
                f"free under {where}); it is not committed and will be ignored. If the disk is full, free space "
                "(or lower train.save_total_limit), then rerun the same command.\n")
    return msg + (f"finetune: last committed checkpoint: {good} (intact; rerunning the same command resumes from it)"
                  if good else "finetune: no committed checkpoint yet; a rerun starts from the beginning")


REQUEUE_EXIT = 75  # EX_TEMPFAIL: stopped on a signal or the deadline; run again to resume
# Plumbing from the launcher (slurm/finetune.sbatch), not recipe knobs:
DEADLINE_ENV = "ZEROTUNE_DEADLINE"  # unix time the job is killed at (SLURM's end time)
PID_DIR_ENV = "ZEROTUNE_PID_DIR"  # each worker registers its pid here, so the batch script signals exactly them
# Step times vary (sequence mix, other jobs on shared storage) and slurmctld enforces limits on a ~30 s poll:
# keep 10% of the next step + save and a minute more in hand.
MARGIN_FRACTION = 0.1
MARGIN_S = 60.0


def seconds_needed(step_s: float, save_s: float) -> float:
    """Time to run one more optimizer step and commit its checkpoint, with the safety margin."""
    return (step_s + save_s) * (1 + MARGIN_FRACTION) + MARGIN_S


def out_of_time(now: float, deadline: float | None, step_s: float | None, save_s: float | None) -> bool:
    """At a step boundary: True when one more step and its save would not end before the deadline, so the run
    must commit now and stop. step_s, save_s: the longest recently measured; a save never measured counts as
    long as a step. No deadline or no measured step: never. When even the save alone no longer fits, it is
    still True: committing now is the best left, and the previous commit stays intact if the save is cut."""
    if deadline is None or step_s is None:
        return False
    return now + seconds_needed(step_s, step_s if save_s is None else save_s) > deadline


def finalize_fits(now: float, deadline: float | None, save_s: float) -> bool:
    """At the last step, whose checkpoint is saved anyway: whether the rest of the job (the consolidated 16-bit
    save, then finalize's reload and check) ends before the deadline, so the job finishes instead of being
    requeued only to finalize. Both move 2 bytes per parameter where a checkpoint moves 14 (fp32 weights, Adam
    m and v, the 16-bit copy): two checkpoint saves, with the margin, bound them. No deadline: unknown, no."""
    return deadline is not None and now + seconds_needed(0, 2 * save_s) <= deadline


class TrainingComplete(Exception):
    """Resumed from the last step's checkpoint: nothing is left to train."""


class EndAtLastStep(TrainerCallback):
    """A job resumed from the last step's checkpoint (its validation failed, or it stopped there to be requeued)
    must train nothing. The Trainer restores global_step only after on_train_begin, skips the trained batches
    and, when max_steps ends inside an epoch, trains one step past max_steps before it checks (transformers 5.23
    trainer.py:1653, :1697-1708, _run_epoch; found by tests/test_rehearsal.py). Raised before that step's first
    forward, on every rank alike (they share the state); the worker then ends training as if it had finished."""

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step >= state.max_steps:
            raise TrainingComplete(f"resumed at the last step ({state.global_step} of {state.max_steps})")


class StopBeforeTraining(Exception):
    """A stop was requested before the first optimizer step of this attempt: there is nothing new to commit."""


class StopOnSignal(TrainerCallback):
    """Stop at the next optimizer-step boundary with a committed checkpoint when SIGUSR1 (SLURM's time-limit
    warning, forwarded by slurm/finetune.sbatch) or SIGTERM arrives, or when the job's deadline
    ($ZEROTUNE_DEADLINE) is too close for another step and its save. Create it first thing in the worker: a
    signal while the model loads or DeepSpeed initialises is remembered (the default action of SIGUSR1 would
    kill the process), and if training has not started when the Trainer is ready, StopBeforeTraining is raised
    on every rank. The decision is reduced across ranks every step so all ranks stop at the same step; a rank
    entering the ZeRO-3 save alone would hang the others."""

    RECENT = 3  # steps whose longest time predicts the next one

    def __init__(self):
        import signal

        self.requested: str | None = None
        self.reason: str | None = None  # why the run stopped: a signal name or "deadline"
        self.stopped_at: int | None = None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)
        deadline = os.environ.get(DEADLINE_ENV, "")
        self.deadline = float(deadline) if deadline else None
        self.step_times: list[float] = []
        self.save_s: float | None = None
        self._step_t0: float | None = None
        self._save_t0: float | None = None
        pid_dir = os.environ.get(PID_DIR_ENV)
        if pid_dir:  # only after the handler is installed: a registered worker survives the signal
            node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
            f = Path(pid_dir) / f"{node}.{os.environ.get('LOCAL_RANK', '0')}.pid"
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(f"{os.getpid()}\n")
            os.replace(tmp, f)  # the batch script never reads half a pid

    def _handle(self, signum, frame):
        import signal

        self.requested = signal.Signals(signum).name

    @staticmethod
    def _max_over_ranks(args, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor(value)
        if dist.is_initialized():
            t = t.to(args.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    @classmethod
    def _all_ranks(cls, args, local: bool) -> bool:
        """True only if true on every rank: a decision that leads ranks into different collectives must agree
        (a SIGTERM, the clock and the measured save time are each rank's own)."""
        return cls._max_over_ranks(args, 0.0 if local else 1.0) == 0

    def on_train_begin(self, args, state, control, **kw):
        if self._max_over_ranks(args, 1.0 if self.requested else 0.0) > 0:
            raise StopBeforeTraining(f"{self.requested or 'a signal on another rank'} received before the first step")
        resumed = last_committed(Path(args.output_dir), quiet=True)
        marker = mf.read(resumed / MARKER) if resumed else None
        self.save_s = (marker or {}).get("save_s")  # the previous attempt's save: known before this one saves
        if self.deadline is not None and state.is_world_process_zero:
            import time

            print(f"finetune: the job ends at {time.strftime('%H:%M:%S', time.localtime(self.deadline))} "
                  f"(in {self.deadline - time.time():,.0f} s): stopping at a step boundary with a committed "
                  "checkpoint when the next step and its save would not fit", flush=True)
        return control

    def on_step_begin(self, args, state, control, **kw):
        import time

        now = time.time()
        if self._save_t0 is not None:  # the last step was saved: the save (and commit) ended here
            self.save_s = max(self.save_s or 0.0, now - self._save_t0)
            self._save_t0 = None
        self._step_t0 = now
        return control

    def on_step_end(self, args, state, control, **kw):
        import time

        now = time.time()
        if self._step_t0 is not None:
            self.step_times = (self.step_times + [now - self._step_t0])[-self.RECENT:]
        step_s = max(self.step_times) if self.step_times else None
        # 2: a signal, 1: the deadline; MAX over ranks, so a signal anywhere wins the reason
        local = 2.0 if self.requested else 1.0 if out_of_time(now, self.deadline, step_s, self.save_s) else 0.0
        flag = self._max_over_ranks(args, local)
        save_s = self.save_s if self.save_s is not None else step_s
        if flag > 0 and state.global_step >= state.max_steps and self._all_ranks(
                args, self.requested in (None, "SIGUSR1") and finalize_fits(now, self.deadline, save_s or 0.0)):
            # the last step: the Trainer saves it and training ends anyway; finishing beats a requeue
            if state.is_world_process_zero:  # (a SIGTERM, a preemption or scancel, still stops: it may be final)
                print(f"finetune: {'the deadline is near' if flag < 2 else self.requested + ' received'} at the last "
                      f"step ({state.global_step}): saving it and finalizing (~{seconds_needed(0, 2 * (save_s or 0.0)):,.0f} s "
                      f"needed, {self.deadline - now:,.0f} s left)", flush=True)
            return control
        if flag > 0:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            self.reason = "deadline" if flag < 2 else (self.requested or "a signal on another rank")
            if state.is_world_process_zero:
                why = (f"{self.reason} received" if flag >= 2 else
                       f"the job ends in {self.deadline - now:,.0f} s and the next step + save needs "
                       f"~{seconds_needed(step_s, self.save_s if self.save_s is not None else step_s):,.0f} s")
                print(f"finetune: {why}: checkpointing at step {state.global_step} and stopping", flush=True)
        if control.should_save:
            self._save_t0 = now
        return control
