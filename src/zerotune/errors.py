"""Errors the user can fix: one message on stderr, exit code 2, no traceback.

Every stage raises a `UserError` (or a subclass: RecipeError, PlanError, BadSample, StaleDataError,
GGUFCheckError, ...) when the cause is in the user's hands: the recipe, the data, a stage not run
yet, a missing model or tokenizer, a damaged GGUF, a plan that does not fit. The message says what
is wrong, where (file, line, key) and how to fix it; `cli.main` prints it once and exits 2.
Anything else is a bug or an environment failure and keeps its traceback. ZEROTUNE_DEBUG=1 prints
the traceback of a user error too.

Under torchrun every rank may hit the same error: local rank 0 prints it and hands it to the
launcher in `runs/<r>/train/error.json` (other ranks write `error.rank<N>.json` silently; the writer is
train/handoff.py's hand_off, which writes atomically through manifest.py, a module this base one must not
import), and train/torchrun.py keeps torchrun's own failure report (a ChildFailedError traceback and a table
per run) off the terminal when a handoff exists.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

EXIT_CODE = 2
HANDOFF = "error.json"


class UserError(Exception):
    """A problem the user can fix; the message names what, where and the fix."""


def why_unreadable(e: Exception) -> str:
    """An OSError's own words ("Is a directory"), else the exception's (a UnicodeDecodeError, a JSON error)."""
    return getattr(e, "strerror", None) or str(e)


class MissingInputError(UserError, FileNotFoundError):
    """A file a stage needs is missing: an earlier stage was not run, or `make setup` was not."""


class BadSample(UserError, ValueError):
    """One data row is unusable (data/sources.py reading it, data/formats.py reading its fields, data/tokenize.py
    rendering it); `where` names the file and line or row, `fix` says what to do."""

    def __init__(self, where: str, reason: str, fix: str = ""):
        self.where, self.reason, self.fix = where, reason, fix
        super().__init__(f"{where}: {reason}" + (f" Fix: {fix}" if fix else ""))

    def __reduce__(self):  # picklable across worker processes
        return (BadSample, (self.where, self.reason, self.fix))


def debug() -> bool:
    return os.environ.get("ZEROTUNE_DEBUG", "") not in ("", "0")


def report(e: BaseException) -> int:
    if debug():
        traceback.print_exception(e)
    print(f"zerotune: {e}", file=sys.stderr, flush=True)
    return EXIT_CODE


def clear_handoffs(train_dir: Path) -> None:
    for f in list(train_dir.glob("error.json")) + list(train_dir.glob("error.rank*.json")):
        f.unlink(missing_ok=True)


def read_handoff(train_dir: Path) -> dict | None:
    """The user error a worker handed off (train/handoff.py hand_off), if any (rank 0's first)."""
    files = sorted(train_dir.glob("error.rank*.json"), key=lambda f: int(f.stem.split("rank")[1]))
    for f in [train_dir / HANDOFF, *files]:
        try:
            return json.loads(f.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return None
