"""When and how a run stops on a signal or its deadline, before it ends on its own: the one home of stopping.

SLURM warns a job before its time limit with SIGUSR1 (slurm/finetune.sbatch forwards it to the workers) and ends
it with SIGTERM; a job that knows its end time ($ZEROTUNE_DEADLINE) stops by itself when the next step and its
save would not fit. Either way the workers stop at an optimizer-step boundary with a committed checkpoint
(checkpoint.py's protocol) and exit with REQUEUE_EXIT, which the launcher and sbatch read as "run again to resume".
The same margin arithmetic (seconds_needed) sizes the warning lead the plan prints (plan.py).

Here: the exit code and the launcher's environment names; the deadline arithmetic; what the workers raise when a
stop leaves nothing to train (StopBeforeTraining, TrainingComplete); and the launcher's own long step that a signal
stops at once (`stoppable()`, `Stopped`: below). The workers' Trainer callbacks that act on these are
train/callbacks.py (transformers' callbacks import peft and bitsandbytes, ~10 s that a launcher process has no use
for); a run that stops because training went wrong (overflow, NaN) is safety.py's. This module imports nothing
heavy (no torch, no transformers) and nothing from zerotune.

A long step of the launcher, stopped at once on a signal: the conversion of a checkpoint for another world size
(reshard.build_conversion, ~27 min at 8B) that `slurm/job.py preflight` runs before any worker starts.
slurm/finetune.sbatch runs the preflight in the background and forwards its time-limit warning (SIGUSR1) to it;
the preflight records a stop from its first line on (`record`). Inside `stoppable()` a stop raises `Stopped` at
once, or at its start when one came before it; outside, a stop is only recorded and the caller reads `asked()`
when it is done. Python runs a signal handler in the main thread between bytecodes, so a stop lands between two
of the converter's file reads or writes (seconds at 8B), never inside one.
"""

from __future__ import annotations

import contextlib
import signal
import threading

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


class StopBeforeTraining(Exception):
    """A stop was requested before the first optimizer step of this attempt: there is nothing new to commit."""


class TrainingComplete(Exception):
    """Resumed from the last step's checkpoint: nothing is left to train."""


# A long step of the launcher (module docstring)

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # the time-limit warning; scancel and preemption
_asked: list[str] = []


class Stopped(BaseException):
    """A stop inside a stoppable step. BaseException, as KeyboardInterrupt is: DeepSpeed's and zerotune's own
    `except Exception` clauses must not turn it into a failure."""

    def __init__(self, signal_name: str, detail: str = ""):
        super().__init__(f"{signal_name} {detail}".strip())
        self.signal, self.detail = signal_name, detail


def record(signum: int, frame=None) -> None:
    """A signal handler that only remembers the stop (installed by slurm/job.py preflight for SIGUSR1)."""
    _asked.append(signal.Signals(signum).name)


def asked() -> str | None:
    """The first stop recorded in this process, by signal name, or None."""
    return _asked[0] if _asked else None


@contextlib.contextmanager
def stoppable(signals=SIGNALS):
    """Raise Stopped inside the block on the first of `signals`; later ones are only recorded, so the cleanup that
    follows a stop runs to its end. The handlers in place before are put back after the block."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
        yield
        return
    if _asked:  # asked before the step began: do not begin it
        raise Stopped(_asked[0])

    def stop(signum, frame):
        for s in signals:
            signal.signal(s, record)
        record(signum)
        raise Stopped(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)  # None: a handler not set from Python


def hold(signals=SIGNALS) -> None:
    """Inside a stoppable block: from now on a stop is only recorded (a cleanup that must not be cut)."""
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            signal.signal(s, record)
