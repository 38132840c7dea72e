"""The processes of one training run, each started from its run folder, never from the user's command line:

    python -m zerotune.train torchrun RUN_DIR TORCHRUN_ARGS...   one per node: torch.distributed.run (torchrun.py)
    python -m zerotune.train worker RUN_DIR                       every rank, as torchrun starts it (worker.py)
    python -m zerotune.train finalize RUN_DIR                     rank 0's last process: verify, publish (finalize.py)

`zerotune finetune` (launch.py) and slurm/finetune.sbatch start them the same way. The launcher resolved the
recipe once, overrides and the allocation applied, into RUN_DIR/train/recipe.resolved.yaml; every rank and
finalize read that file, so they cannot disagree with it or with each other.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..config import load_recipe
from ..errors import MissingInputError, UserError, report
from ..layout import RunLayout
from ..quiet import silence_known_noise
from .finalize import finalize
from .handoff import hand_off
from .torchrun import run_torchrun

ROLES = ("torchrun", "worker", "finalize")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ROLES:
        print(__doc__, file=sys.stderr)
        return 2
    role, run = argv[0], Path(argv[1])

    # every role, torchrun's too: the workers import transformers' callbacks (train/callbacks.py), hence peft
    # and bitsandbytes, whose import logs a warning on CPUs with AVX512-BF16 (quiet.py)
    silence_known_noise()
    if role == "torchrun":
        return run_torchrun(run, argv[2:])

    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    paths = RunLayout(run)
    try:
        if not paths.run_recipe.exists():
            raise MissingInputError(f"{paths.run_recipe} not found: these processes are started by `make "
                                    "finetune RECIPE=...` or slurm/finetune.sbatch, which write it first.")
        r = load_recipe(str(paths.run_recipe))
        if role == "worker":
            from .worker import worker
            worker(r)
        else:
            finalize(r)
    except UserError as e:  # a worker hands it to the launcher (printed once, by local rank 0)
        return hand_off(paths.train, e) if role == "worker" else report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
