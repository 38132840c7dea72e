"""The workers' Trainer callbacks of the commit protocol and of stopping: CommitCheckpoints commits each saved step
(checkpoint.py's protocol); EndAtLastStep and StopOnSignal stop training before the epoch loop ends on its own (a
signal, the job's deadline, nothing left to train; the arithmetic, the signals, the exceptions and the exit code:
stopping.py). Apart from checkpoint.py and stopping.py because transformers' callbacks import peft and bitsandbytes
(~7 s), which the launcher, the planner and the conversion for another world size (reshard.py) have no use for."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback

from .. import manifest as mf
from ..checkpoint import CommitMarker, file_sizes, last_committed, rotate
from ..metrics import max_over_ranks
from ..safety import check_weights, local_weights_finite
from ..stopping import (
    DEADLINE_ENV,
    PID_DIR_ENV,
    SIGNALS,
    StopBeforeTraining,
    TrainingComplete,
    finalize_fits,
    out_of_time,
    seconds_needed,
)


class CommitCheckpoints(TrainerCallback):
    """Replaces HF's save_total_limit rotation (give the Trainer save_total_limit=None).

    bp: the run's batch.BatchPlan, written into each marker: a resume at another world size keeps the global
    batch in tokens and re-derives grad-accum, and checks against it (reshard.refuse_unresumable)."""

    def __init__(self, keep: int | None, bp=None):
        self.keep = keep
        self.batch = bp.record() if bp is not None else {}
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
            CommitMarker(state.global_step, args.world_size, **self.batch, save_s=round(time.time() - self.save_t0, 3),
                         files=file_sizes(ckpt)).write(ckpt)
            os.sync()
            gone = rotate(ckpt.parent, self.keep)
            print(f"checkpoint: committed {ckpt.name}" + (f"; removed {', '.join(gone)}" if gone else ""), flush=True)
        if dist.is_initialized():
            dist.barrier()
        return control


class EndAtLastStep(TrainerCallback):
    """A job resumed from the last step's checkpoint (its validation failed, or it stopped there to be requeued)
    must train nothing. The Trainer restores global_step only after on_train_begin, skips the trained batches
    and, when max_steps ends inside an epoch, trains one step past max_steps before it checks (transformers 5.23
    trainer.py:1653, :1697-1708, _run_epoch; found by tests/test_rehearsal.py). Raised before that step's first
    forward, on every rank alike (they share the state); the worker then ends training as if it had finished."""

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step >= state.max_steps:
            raise TrainingComplete(f"resumed at the last step ({state.global_step} of {state.max_steps})")


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
        for sig in SIGNALS:
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
            mf.write_atomic(f, f"{os.getpid()}\n")  # the batch script never reads half a pid

    def _handle(self, signum, frame):
        import signal

        self.requested = signal.Signals(signum).name

    @classmethod
    def _all_ranks(cls, args, local: bool) -> bool:
        """True only if true on every rank: a decision that leads ranks into different collectives must agree
        (a SIGTERM, the clock and the measured save time are each rank's own)."""
        return max_over_ranks(0.0 if local else 1.0, args.device) == 0

    def on_train_begin(self, args, state, control, **kw):
        if max_over_ranks(1.0 if self.requested else 0.0, args.device) > 0:
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
        flag = max_over_ranks(local, args.device)
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
