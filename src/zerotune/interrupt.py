"""Stopping a long step of the launcher at once on a signal: the universal conversion (universal.convert, ~27 min
at 8B) that `slurm/job.py preflight` runs before any worker starts.

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
