"""Read rows from local files or the hub, each tagged with where it came from.

Every row carries (file, row number) so a bad sample can be reported as
`train.jsonl line 17: ...`. Local JSONL is parsed line by line for exactly that
reason; other formats go through `datasets`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..config import SourceCfg, resolve_path

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class BadSample(ValueError):
    """One row is unusable; `where` names the file and line or row."""

    def __init__(self, where: str, reason: str, fix: str = ""):
        self.where, self.reason, self.fix = where, reason, fix
        super().__init__(f"{where}: {reason}" + (f" Fix: {fix}" if fix else ""))


@dataclass
class Row:
    source: int
    where: str
    data: dict | None  # None when the raw line itself is unreadable (error in `error`)
    error: BadSample | None = None


def _jsonl_rows(path: Path, idx: int) -> Iterator[Row]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path.name} line {lineno}"
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Row(idx, where, None, BadSample(where, f"not valid UTF-8 ({e.reason} at byte {e.start}).",
                                                     "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield Row(idx, where, None, BadSample(where, f"malformed JSON ({e.msg}, column {e.colno}).",
                                                     "each line must be one JSON object."))
                continue
            if not isinstance(obj, dict):
                yield Row(idx, where, None, BadSample(where, f"expected a JSON object, got {type(obj).__name__}."))
                continue
            yield Row(idx, where, obj)


def _dataset_rows(src: SourceCfg, idx: int, path: Path | None) -> Iterator[Row]:
    import datasets

    if path is not None:
        builder = LOCAL_SUFFIXES[path.suffix]
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        label = path.name
    else:
        ds = datasets.load_dataset(src.path, src.name, split=src.split, revision=src.revision)
        label = f"{src.path}[{src.split}]"
    for i, obj in enumerate(ds):
        yield Row(idx, f"{label} row {i}", dict(obj))


def read_source(src: SourceCfg, idx: int) -> Iterator[Row]:
    path = resolve_path(src.path)
    if path is not None and path.exists():
        if path.suffix not in LOCAL_SUFFIXES:
            raise ValueError(f"data source {src.path}: unsupported file type '{path.suffix}'. "
                             f"Use one of {sorted(LOCAL_SUFFIXES)}.")
        if path.suffix == ".jsonl":
            yield from _jsonl_rows(path, idx)
        else:
            yield from _dataset_rows(src, idx, path)
    elif src.path.endswith(tuple(LOCAL_SUFFIXES)) or src.path.startswith(("/", ".")):
        raise FileNotFoundError(f"data source {src.path}: file not found (resolved to {path}).")
    else:
        yield from _dataset_rows(src, idx, None)


def mixture(sources: list[SourceCfg], seed: int) -> Iterator[Row]:
    """Rows of all sources; `weight` keeps that fraction of a source's rows (>1 repeats)."""
    rng = random.Random(seed)
    for idx, src in enumerate(sources):
        rows = list(read_source(src, idx))
        whole, frac = int(src.weight), src.weight - int(src.weight)
        picked = rows * whole
        if frac > 0:
            picked += rng.sample(rows, round(frac * len(rows)))
        yield from picked
