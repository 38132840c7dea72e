"""How every stage writes its outputs: one atomic file write, JSON, JSON Lines, and publishing a finished folder
or file.

A stage builds its output beside the published one and publishes it only when it is complete and checked,
so a failed or interrupted stage leaves the earlier output intact (nothing is lost). A single file is written by
`write_atomic` (a temp file beside it, then a rename), the one place that does so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, fsync: bool = False) -> None:
    """Write `data` (text as UTF-8) to `path` through a temp file beside it and a rename, so a reader sees the old
    file or the new one, never half of one. The temp name holds this process's pid: two processes writing the same
    file never write into each other's temp file. fsync: the bytes reach the disk before the rename (a crash then
    leaves the old file or the whole new one, never an empty one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write(path: Path, obj: dict) -> None:
    """Write JSON atomically, fsynced (write_atomic), so a reader never sees half a file."""
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n", fsync=True)


def read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_jsonl(path: Path) -> list[dict]:
    """Every row of a JSON Lines file zerotune wrote (blank lines skipped); [] when there is no file yet."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def append_jsonl(path: Path, rows: list[dict] | dict) -> None:
    """Append whole lines and flush them: a reader (or a resumed run) sees complete rows only."""
    rows = [rows] if isinstance(rows, dict) else rows
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(x, default=str) + "\n" for x in rows))
        f.flush()


def rewind_jsonl(path: Path, step: int, discard_to: Path | None = None) -> int:
    """A run resumed from checkpoint `step`: rows the interrupted attempt logged after it go (to `discard_to` when
    given, so nothing is silently lost), so each step appears once; step 0 (a fresh run) starts the file anew.
    Returns how many rows were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    if step == 0:
        path.unlink()
        return 0
    rows = read_jsonl(path)
    keep = [x for x in rows if x["step"] <= step]
    dropped = [x for x in rows if x["step"] > step]
    if dropped:
        if discard_to is not None:
            append_jsonl(discard_to, dropped)
        write_atomic(path, "".join(json.dumps(x, default=str) + "\n" for x in keep))
    return len(dropped)


def amend_jsonl(path: Path, step: int, fields: dict) -> bool:
    """Add `fields` to the row of `step` (written earlier), replacing the file atomically: a reader sees the old
    or the new file, never half. For measurements that finish after their step's row was written (validation
    runs after the step's checkpoint is committed). False when no row has that step."""
    path = Path(path)
    rows = read_jsonl(path) if path.exists() else []
    hit = [x for x in rows if x["step"] == step]
    for x in hit:
        x.update(fields)
    if hit:
        write_atomic(path, "".join(json.dumps(x, default=str) + "\n" for x in rows))
    return bool(hit)


def _fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(staged: Path, final: Path) -> None:
    """Make `staged` (a complete, checked folder or file beside `final`) the new `final`.

    Its bytes reach the disk first; the old output is moved aside, the new one renamed in, and only then is the
    old one removed, so at every instant one complete copy exists (as `final`, or as `final.old` during the two
    renames). Both must be on one file system: that is why stages stage *beside* their output.
    """
    staged, final = Path(staged), Path(final)
    if not staged.exists():
        raise FileNotFoundError(f"nothing staged at {staged} to publish as {final}")
    _fsync_tree(staged)
    old = final.with_name(final.name + ".old")
    _remove(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staged, final)
    fd = os.open(final.parent, os.O_RDONLY)  # the renames themselves must survive a crash
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
