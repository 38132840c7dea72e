"""torch.distributed.run for one training run, quiet when the workers ended the way zerotune asked them to.

Two endings are the protocol, not failures: the workers stopped on a signal or the deadline (stopped.json,
exit 75: run again to resume) or hit a user error (error.json: local rank 0 has printed the one message, exit
2). torchrun would report both with a ChildFailedError traceback and a failure table; the log would then say
the opposite of what happened. Any other failure keeps everything torchrun prints.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import EXIT_CODE, read_handoff
from ..layout import RunLayout
from ..stopping import REQUEUE_EXIT


def run_torchrun(run_dir: Path, argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main

    run = RunLayout(Path(run_dir))

    def unexpected(_record) -> bool:  # checked when a record is emitted, i.e. after a worker ended
        return not run.stopped.exists() and read_handoff(run.train) is None

    # On every handler torch has set up by now (its own glog-style one on "torch" included): a filter on a
    # logger does not see its children's records.
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for h in {h for lg in loggers for h in lg.handlers} | {logging.lastResort}:
        h.addFilter(unexpected)
    try:
        main(argv)
    except (ChildFailedError, SignalException, RendezvousError):
        # Two races of a multi-node ending, both after the workers' last barrier: another node's torchrun exited
        # 75 first and srun --kill-on-bad-exit sent this one SIGTERM (SignalException, re-raised by
        # torch/distributed/launcher/api.py), or that torchrun hosted the rendezvous store and this one's monitor
        # loop asked it for waiting nodes after it was gone (RendezvousConnectionError, agent/server/api.py
        # _invoke_run: seen in CI on the two-node SLURM cluster)
        if run.stopped.exists():
            return REQUEUE_EXIT
        if read_handoff(run.train) is not None:
            return EXIT_CODE
        raise
    return 0
