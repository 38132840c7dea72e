"""Read rows from local files or the hub, one at a time, each tagged with where it came from.

Every row carries a location such as `data/train.jsonl line 17` or
`data/train.parquet row 3` so a bad sample is reported where the user can find
it. Local files are read by this module, streaming where the format allows:

- `.jsonl`: line by line (binary, so a non-UTF-8 line is one bad row, not a crash);
- `.json`: a JSON array of objects (loaded whole, as the format requires) or,
  if the file is really JSON Lines, line by line;
- `.csv`: the `csv` module, streaming, with line numbers; a `messages` cell may
  hold a JSON list;
- `.parquet`: pyarrow record batches, streaming.

Hub data sets go through `datasets` (memory-mapped Arrow in the HF cache).
Rows are never all held in memory: `mixture` streams each source and applies
its weight with a per-row 0/1 mask (1 byte per row).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import SourceCfg, resolve_path
from ..errors import BadSample, UserError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
SKIP_HINT = "Or set data.on_bad_sample: skip to drop such rows and count them in the manifest."


class SourceError(UserError, ValueError):
    """A whole source is unusable (missing file, unsupported type, unreadable file)."""


@dataclass
class Row:
    source: int
    where: str
    data: dict | None  # None when the raw line itself is unreadable (error in `error`)
    error: BadSample | None = None


def _decode_json_line(raw: bytes, where: str, idx: int) -> Row:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Row(idx, where, None, BadSample(
            where, f"not valid UTF-8 ({e.reason} at byte {e.start} of the line).",
            "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`)."))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Row(idx, where, None, BadSample(
            where, f"malformed JSON ({e.msg} at column {e.colno}).",
            "each line must be one complete JSON object; repair or delete this line."))
    if not isinstance(obj, dict):
        return Row(idx, where, None, BadSample(where, f"expected a JSON object, got {type(obj).__name__}.",
                                               "each line must be one JSON object like {\"messages\": [...]}."))
    return Row(idx, where, obj)


def _jsonl_rows(path: Path, label: str, idx: int) -> Iterator[Row]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield _decode_json_line(raw, f"{label} line {lineno}", idx)


def _json_rows(path: Path, label: str, idx: int) -> Iterator[Row]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SourceError(f"{label} line {line}: not valid UTF-8 ({e.reason} at byte {e.start}). Fix: re-encode "
                          "the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("{") and e.msg == "Extra data":
            yield from _jsonl_rows(path, label, idx)  # JSON Lines saved as .json
            return
        raise SourceError(f"{label} line {e.lineno} column {e.colno}: malformed JSON ({e.msg}). Fix: a .json source "
                          "must be one JSON array of objects (or use .jsonl, one object per line).") from None
    if isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), list):
        obj = next(iter(obj.values()))  # {"data": [...]}
    if not isinstance(obj, list):
        raise SourceError(f"{label}: expected a JSON array of objects, got {type(obj).__name__}. "
                          "Fix: store the rows as [{...}, {...}] or as JSON Lines (.jsonl).")
    for i, item in enumerate(obj):
        where = f"{label} record {i}"
        if isinstance(item, dict):
            yield Row(idx, where, item)
        else:
            yield Row(idx, where, None, BadSample(where, f"expected a JSON object, got {type(item).__name__}.",
                                                   "every array element must be an object."))


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _csv_rows(path: Path, label: str, idx: int) -> Iterator[Row]:
    # surrogateescape keeps undecodable bytes so the row that holds them is reported, not the whole file.
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        start = 2
        for rec in reader:
            where = f"{label} line {start}"
            start = reader.line_num + 1
            if None in rec:
                yield Row(idx, where, None, BadSample(where, f"{len(rec[None])} more cells than header columns.",
                                                       "quote cells that contain commas."))
                continue
            if any(isinstance(v, str) and _has_surrogates(v) for v in rec.values()):
                yield Row(idx, where, None, BadSample(where, "not valid UTF-8.",
                                                       "re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."))
                continue
            yield Row(idx, where, {k: (None if v is None else v) for k, v in rec.items()})


def _parquet_rows(path: Path, label: str, idx: int) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types
        raise SourceError(f"{label}: not a readable Parquet file ({e}). Fix: rewrite it with pandas/pyarrow.") from None
    i = 0
    for batch in pf.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield Row(idx, f"{label} row {i}", obj)
            i += 1


def _hub_dataset(src: SourceCfg):
    import datasets

    return datasets.load_dataset(src.path, src.name, split=src.split, revision=src.revision)


def _local_path(src: SourceCfg) -> Path | None:
    path = resolve_path(src.path)
    if path is not None and path.exists():
        if path.is_dir():
            files = sorted(p.name for p in path.iterdir() if p.suffix in LOCAL_SUFFIXES)
            raise SourceError(f"data source {src.path}: a folder; list its files as sources, one each "
                              f"(data.sources: [{{path: {src.path.rstrip('/')}/{files[0] if files else 'part-0.jsonl'}}}, "
                              f"...]){f' ({len(files)} data files there)' if files else ''}.")
        if path.suffix not in LOCAL_SUFFIXES:
            raise SourceError(f"data source {src.path}: unsupported file type '{path.suffix}'. "
                              f"Use one of {list(LOCAL_SUFFIXES)}.")
        return path
    # a hub id is owner/name: a longer path, or one under a local folder, is a local file that is not there
    first = src.path.split("/")[0]
    if (src.path.endswith(LOCAL_SUFFIXES) or src.path.startswith(("/", ".")) or src.path.count("/") > 1
            or (first and (resolve_path(first) or Path()).is_dir())):
        raise SourceError(f"data source {src.path}: file not found (resolved to {path}). "
                          "Fix: check the path (relative paths are relative to the repository root).")
    return None


def read_source(src: SourceCfg, idx: int) -> Iterator[Row]:
    path = _local_path(src)
    if path is None:
        ds = _hub_dataset(src)
        for i, obj in enumerate(ds):
            yield Row(idx, f"{src.path}[{src.split}] row {i}", dict(obj))
        return
    label = src.path
    reader = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}[path.suffix]
    yield from reader(path, label, idx)


def count_rows(src: SourceCfg, idx: int) -> int:
    """Rows `read_source` yields (bad ones included), cheaply where possible."""
    path = _local_path(src)
    if path is None:
        return len(_hub_dataset(src))
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types, as in _parquet_rows
            raise SourceError(f"data source {src.path}: not a readable Parquet file ({e}). Fix: rewrite it with "
                              f"pandas/pyarrow.") from None
    return sum(1 for _ in read_source(src, idx))


def mixture_plan(sources: list[SourceCfg], seed: int) -> list[dict]:
    """Per source: row count, full passes and the 0/1 mask of rows taken in the fractional pass.

    weight 2.0 = every row twice, 0.5 = a seeded random half (exactly round(0.5 * n) rows),
    2.5 = every row twice plus a random half.
    """
    rng = np.random.default_rng(seed)
    plan = []
    for idx, src in enumerate(sources):
        n = count_rows(src, idx)
        whole = int(math.floor(src.weight))
        frac = src.weight - whole
        k = int(round(frac * n))
        if n and whole * n + k == 0:  # a source listed and then left out without a word
            raise SourceError(f"data.sources[{idx}] ({src.path}): weight {src.weight:g} takes 0 of its {n} rows; "
                              f"raise it above {1 / (2 * n):.3g}, or remove the source.")
        mask = None
        if k > 0:
            mask = np.zeros(n, dtype=bool)
            mask[rng.choice(n, size=k, replace=False)] = True
        plan.append({"rows": n, "passes": whole, "mask": mask, "taken": whole * n + k})
    return plan


def mixture(sources: list[SourceCfg], seed: int, plan: list[dict] | None = None) -> Iterator[Row]:
    """Rows of all sources, streamed, each source repeated/subsampled by its weight."""
    plan = plan if plan is not None else mixture_plan(sources, seed)
    for idx, (src, p) in enumerate(zip(sources, plan)):
        for _ in range(p["passes"]):
            yield from read_source(src, idx)
        if p["mask"] is not None:
            mask = p["mask"]
            for i, row in enumerate(read_source(src, idx)):
                if i < len(mask) and mask[i]:
                    yield row
