"""The two steps of slurm/finetune.sbatch that need the recipe, so the script never reads YAML itself.

  python slurm/job.py preflight RECIPE [section.key=value ...]
      Before srun starts any worker: the plan for this allocation (printed to the log), prepared data that
      matches the recipe, the disk, the base model, and a checkpoint written at another world size converted
      for this allocation's (nodes x processes): what `zerotune finetune` does before torchrun
      (train/launch.py before_launch). stdout gets one line for the script: PROCS_PER_NODE DEVICE RUN_DIR.
      A user error: one message, exit 2.
      The batch script runs it in the background and forwards its time-limit warning (USR1) to it: a conversion
      stops at once, leaving the checkpoint as it was and nothing half-built, and the preflight exits 75 (requeue
      it; the second such stop in a row without a trained step exits 1). A conversion estimated not to end before
      the warning ($ZEROTUNE_DEADLINE - SIGNAL_LEAD_S) is not started: one message, exit 2.
      It also resolves the recipe (overrides and the allocation applied) into RUN_DIR/train/recipe.resolved.yaml,
      which every rank and finalize read: srun starts `python -m zerotune.train torchrun RUN_DIR ...` on each
      node, as `zerotune finetune` does on one (src/zerotune/train/__main__.py).
  python slurm/job.py outcome RUN_DIR SRUN_EXIT
      After srun: what happened (train/handoff.py's Outcome, as `zerotune finetune` reads it), in the last lines
      of the job log, and the script's exit code: 0 trained and published, 75 stopped (requeue it), 2 a user
      error (fix it, resubmit), anything else failed (do not requeue).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zerotune.quiet import silence_known_noise

# The preflight's stdout is one line finetune.sbatch reads (processes per node, device, run folder). Everything else
# goes to stderr, the job's log, from the first import on: a library may print while importing (transformers prints
# "[INFO] Running in WANDB offline mode" under WANDB_MODE=offline, integrations/integration_utils.py:40-41, which
# would become the process count).
RESULT = sys.stdout
if sys.argv[1:2] == ["preflight"]:
    RESULT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

# as every zerotune process does (cli.main), before the imports below load the libraries that log it
silence_known_noise()

from zerotune import manifest as mf  # noqa: E402
from zerotune.checkpoint import last_committed  # noqa: E402
from zerotune import stopping  # noqa: E402
from zerotune.stopping import DEADLINE_ENV, REQUEUE_EXIT  # noqa: E402
from zerotune.config import load_recipe  # noqa: E402
from zerotune.errors import EXIT_CODE, UserError, report  # noqa: E402
from zerotune.layout import RunLayout  # noqa: E402
from zerotune.train.handoff import Outcome  # noqa: E402

# finetune.sbatch's warning lead (#SBATCH --signal=B:USR1@900; tests/test_slurm.py checks that they agree). A
# --signal given to sbatch overrides the script's but not this: SLURM does not tell a job its own lead.
SIGNAL_LEAD_S = 900


def preflight(recipe: str, overrides: list[str]) -> int:
    import signal

    # The batch script forwards its USR1 here (its default action would kill this process): a conversion stops on
    # it at once (reshard.build_conversion); anything else finishes, and then the preflight stops instead of launching.
    signal.signal(signal.SIGUSR1, stopping.record)
    try:
        return _preflight(recipe, overrides)
    finally:
        # The script sends a pending USR1 again every 2 s until this process is gone, and at exit Python puts the
        # default action (kill: exit 138, not this one's code) back for a handler it set, but not for an ignored one.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _preflight(recipe: str, overrides: list[str]) -> int:
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.report import format_plan
    from zerotune.train.launch import before_launch

    deadline = os.environ.get(DEADLINE_ENV)
    convert_by = float(deadline) - SIGNAL_LEAD_S if deadline else None
    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
    nodes = int(os.environ.get("SLURM_NNODES") or 1)
    try:
        r = load_recipe(recipe, overrides)
        procs = gpus or r.train.cpu_procs
        # the allocation, not the recipe's plan: section, is what the plan and its checks must describe
        r = load_recipe(recipe, [*overrides, f"plan.nodes={nodes}", f"plan.gpus_per_node={procs}"])
        plan = compute_plan(r)  # once: printed here, then every check of before_launch reads it
        print(format_plan(plan), flush=True)
        before_launch(r, nodes * procs, plan=plan, convert_by=convert_by)
    except UserError as e:
        return report(e)
    except stopping.Stopped as e:
        return stopped_in_preflight(r.out, e.signal, e.detail)
    if stopping.asked():
        return stopped_in_preflight(r.out, stopping.asked(), "before the launch")
    print(procs, "GPU" if gpus else "CPU", r.out, file=RESULT, flush=True)
    return 0


def stopped_in_preflight(run_dir: Path, signal: str, detail: str) -> int:
    """A stop before any worker started: requeued once (75); the second in a row without a trained step is not
    (1), as outcome() does for workers stopped before their first step: the same job would stop there again."""
    job = os.environ.get("SLURM_JOB_ID", "?")
    no_progress = RunLayout(run_dir).no_progress
    said = f"finetune: stopped by {signal} during the preflight, {detail}"
    if (mf.read(no_progress) or {}).get("job") == job:
        print(f"{said}, for the second attempt in a row without a trained step: not requeued. The time left after "
              f"startup is shorter than the preflight (a conversion to another world size: its estimate is above) "
              f"plus the warning lead (--signal). Resubmit with a longer --time, or on the number of GPUs that "
              f"wrote the checkpoint.", file=sys.stderr, flush=True)
        return 1
    mf.write(no_progress, {"job": job})
    then = (f"requeueing job {job}, which runs the preflight again" if signal == "SIGUSR1" else
            "the job is ending (scancel, preemption): resubmit the same command unless SLURM requeues it")
    print(f"{said}; {then}", file=sys.stderr, flush=True)
    return REQUEUE_EXIT


def outcome(run_dir: Path, srun_rc: int) -> int:
    job = os.environ.get("SLURM_JOB_ID", "?")
    run = RunLayout(run_dir)
    o = Outcome.read(run, srun_rc)
    stopped, no_progress = o.stopped, run.no_progress
    if stopped and stopped.committed:
        no_progress.unlink(missing_ok=True)
        print(f"finetune: stopped by {stopped.signal} at step {stopped.step}: checkpoint committed "
              f"({stopped.checkpoint}); requeueing job {job}, which resumes from it", flush=True)
        return REQUEUE_EXIT
    if stopped:
        start = stopped.checkpoint or "the beginning"
        if (mf.read(no_progress) or {}).get("job") == job:
            # twice in a row without one step: requeueing again would loop until someone notices
            print(f"finetune: stopped by {stopped.signal} before training started, for the second attempt in a "
                  f"row: no new checkpoint. Not requeued: the time left after startup is shorter than the warning "
                  f"lead (--signal) or one step. Raise --time, then resubmit; it starts from {start}.", flush=True)
            return 1
        mf.write(no_progress, {"job": job})
        print(f"finetune: stopped by {stopped.signal} before training started: no new checkpoint; requeueing "
              f"job {job}, which starts from {start}", flush=True)
        return REQUEUE_EXIT
    no_progress.unlink(missing_ok=True)
    if o.user_error:  # printed by the worker's local rank 0 unless only another rank hit it
        if not o.user_error["printed"]:
            print(f"zerotune: {o.user_error['message']}", flush=True)
        print("finetune: a worker stopped on the user error above; not requeued: fix it and resubmit the same "
              "command", flush=True)
        return EXIT_CODE
    if srun_rc == 0:
        print(f"finetune: finished: model published in {run.model}", flush=True)
        return 0
    good = last_committed(run.checkpoints, quiet=True)
    print(f"finetune: training failed (srun exit {srun_rc}); not requeued. "
          + (f"Last committed checkpoint: {good}; resubmitting the same command resumes from it."
             if good else "No checkpoint was committed; resubmitting starts from the beginning."), flush=True)
    return srun_rc


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "preflight":
        return preflight(argv[1], argv[2:])
    if len(argv) == 3 and argv[0] == "outcome":
        return outcome(Path(argv[1]), int(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
