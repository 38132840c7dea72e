"""When the training workers stop before the epoch loop ends on its own: a signal, the job's deadline, or nothing
left to train.

SLURM warns a job before its time limit with SIGUSR1 (slurm/finetune.sbatch forwards it to the workers) and ends
it with SIGTERM; a job that knows its end time ($ZEROTUNE_DEADLINE) stops by itself when the next step and its
save would not fit. Either way the workers stop at an optimizer-step boundary with a committed checkpoint
(checkpoint.py's protocol) and exit with REQUEUE_EXIT, which the launcher and sbatch read as "run again to resume".
The same margin arithmetic (seconds_needed) sizes the warning lead the plan prints (plan.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback

from .checkpoint import CommitMarker, last_committed

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


def finalize_fits(now: float, deadline: float | None, save_s: float, end_s: float = 0.0) -> bool:
    """At the last step, whose checkpoint is saved anyway: whether the rest of the job ends before the deadline,
    so the job finishes instead of being requeued only to finalize: the end of training's validation and samples
    (end_s: at 8B on several nodes they take minutes, and a job killed inside them is not requeued), then the
    consolidated 16-bit save and finalize's reload and check. Those two move 2 bytes per parameter where a
    checkpoint moves 14 (fp32 weights, Adam m and v, the 16-bit copy): two checkpoint saves, with the margin,
    bound them. No deadline: unknown, no."""
    return deadline is not None and now + seconds_needed(0, 2 * save_s + end_s) <= deadline


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
        # seconds the end of training's validation and samples take, and how that is known (train/validation.py
        # EvalDuringTraining.end_of_training_s: measured this attempt, else the launch's plan); None: unknown
        self.end_estimate = lambda: None
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
        marker = CommitMarker.read(resumed) if resumed else None
        self.save_s = marker.save_s if marker else None  # the previous attempt's save: known before this one saves
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
        last_why = None
        if state.global_step >= state.max_steps and (flag > 0 or self.deadline is not None):
            # the last step: the Trainer saves it, then the end of training validates, samples, consolidates and
            # finalizes; finishing beats a requeue when all of that fits (a SIGTERM, a preemption or scancel, still
            # stops: it may be final), else it stops here committed and the requeued job does the rest
            end_s, how = self.end_estimate() or (step_s or 0.0, "assumed: one step")
            need = seconds_needed(0, 2 * (save_s or 0.0) + end_s)
            if self._all_ranks(args, self.requested in (None, "SIGUSR1")
                               and finalize_fits(now, self.deadline, save_s or 0.0, end_s)):
                if flag > 0 and state.is_world_process_zero:
                    print(f"finetune: {'the deadline is near' if flag < 2 else self.requested + ' received'} at the "
                          f"last step ({state.global_step}): saving it and finalizing (~{need:,.0f} s needed, "
                          f"validation and samples ~{end_s:,.0f} s {how}; {self.deadline - now:,.0f} s left)", flush=True)
                return control
            if flag < 2:  # no next step to fit: what follows the last one does not
                flag = 1.0
                last_why = (f"the job ends in {self.deadline - now:,.0f} s and the end of training needs ~{need:,.0f} s "
                            f"(validation and samples ~{end_s:,.0f} s {how}, the consolidated save and finalize); "
                            "the requeued job validates and finalizes")
        if flag > 0:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            self.reason = "deadline" if flag < 2 else (self.requested or "a signal on another rank")
            if state.is_world_process_zero:
                why = (f"{self.reason} received" if flag >= 2 else last_why or
                       f"the job ends in {self.deadline - now:,.0f} s and the next step + save needs "
                       f"~{seconds_needed(step_s, self.save_s if self.save_s is not None else step_s):,.0f} s")
                print(f"finetune: {why}: checkpointing at step {state.global_step} and stopping", flush=True)
        if control.should_save:
            self._save_t0 = now
        return control
