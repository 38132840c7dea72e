"""The two steps of slurm/finetune.sbatch that need the recipe, so the script never reads YAML itself.

  python slurm/job.py preflight RECIPE [section.key=value ...]
      Before srun starts any worker: the plan for this allocation (printed to the log), prepared data that
      matches the recipe, the disk, the base model, and a checkpoint written at another world size converted
      for this allocation's (nodes x processes): what `zerotune finetune` does before torchrun
      (train.before_launch). stdout gets one line for the script: PROCS_PER_NODE DEVICE RUN_DIR.
      A user error: one message, exit 2.
      It also resolves the recipe (overrides and the allocation applied) into RUN_DIR/train/recipe.resolved.yaml,
      which every rank and finalize read: srun starts `python -m zerotune.train torchrun RUN_DIR ...` on each
      node, as `zerotune finetune` does on one (src/zerotune/train/__main__.py).
  python slurm/job.py outcome RUN_DIR SRUN_EXIT
      After srun: what happened (train/handoff.py's Outcome, as `zerotune finetune` reads it), in the last lines
      of the job log, and the script's exit code: 0 trained and published, 75 stopped (requeue it), 2 a user
      error (fix it, resubmit), anything else failed (do not requeue).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from zerotune.quiet import silence_known_noise

# as every zerotune process does (cli.main), before the imports below load the libraries that log it
silence_known_noise()

from zerotune import manifest as mf  # noqa: E402
from zerotune.checkpoint import last_committed  # noqa: E402
from zerotune.stopping import REQUEUE_EXIT  # noqa: E402
from zerotune.config import load_recipe  # noqa: E402
from zerotune.errors import EXIT_CODE, UserError, report  # noqa: E402
from zerotune.layout import RunLayout  # noqa: E402
from zerotune.train.handoff import Outcome  # noqa: E402


def preflight(recipe: str, overrides: list[str]) -> int:
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.report import format_plan
    from zerotune.train import before_launch

    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
    nodes = int(os.environ.get("SLURM_NNODES") or 1)
    try:
        r = load_recipe(recipe, overrides)
        procs = gpus or r.train.cpu_procs
        # the allocation, not the recipe's plan: section, is what the plan and its checks must describe
        r = load_recipe(recipe, [*overrides, f"plan.nodes={nodes}", f"plan.gpus_per_node={procs}"])
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the script's one line
            plan = compute_plan(r)  # once: printed here, then every check of before_launch reads it
            print(format_plan(plan), flush=True)
            before_launch(r, nodes * procs, plan=plan)
    except UserError as e:
        return report(e)
    print(procs, "GPU" if gpus else "CPU", r.out)
    return 0


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
