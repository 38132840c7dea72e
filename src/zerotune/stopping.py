"""When the training workers stop before the epoch loop ends on its own: a signal, the job's deadline, or nothing
left to train.

SLURM warns a job before its time limit with SIGUSR1 (slurm/finetune.sbatch forwards it to the workers) and ends
it with SIGTERM; a job that knows its end time ($ZEROTUNE_DEADLINE) stops by itself when the next step and its
save would not fit. Either way the workers stop at an optimizer-step boundary with a committed checkpoint
(checkpoint.py's protocol) and exit with REQUEUE_EXIT, which the launcher and sbatch read as "run again to resume".
The same margin arithmetic (seconds_needed) sizes the warning lead the plan prints (plan.py).

This module is the arithmetic and the names the launcher, the planner and the universal conversion share, and imports
nothing: the workers' Trainer callbacks that act on it are train/callbacks.py (transformers' callbacks import
peft and bitsandbytes, ~10 s that a launcher process has no use for).
"""

from __future__ import annotations


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
