"""Best-fit-decreasing packing of documents into fixed-length sequences.

Positions restart at 0 for every document. With `use_cache=False` transformers
turns restarting `position_ids` into a block-causal mask (SDPA, eager) or
varlen boundaries (FlashAttention 2), so packed documents never attend to each
other; tests/test_packing.py checks packed logits equal per-document logits.

Only the document lengths are needed to plan the bins (a few bytes per
document), so the documents themselves can stay on disk (memory-mapped Arrow)
while packed rows are written out in batches.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable, Iterator

import numpy as np

from .tokenize import IGNORE


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins of document indices; each bin's total length <= capacity.

    Each document, longest first, goes into the open bin with the least room
    that still fits it (ties: the oldest bin), else a new bin. Deterministic.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        i = int(lengths.argmax())
        raise ValueError(f"document {i} has {int(lengths[i])} tokens > capacity {capacity}; truncate or drop it first")
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id) of bins with room left
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            rem, b = free.pop(k)
        else:
            rem, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if rem - n > 0:
            bisect.insort(free, (rem - n, b))
    return bins


def packed_row(docs: Iterable[tuple], seq_len: int, pad_id: int) -> tuple[dict, int]:
    """One row {input_ids, labels, position_ids} of seq_len from (ids, labels) docs; returns (row, padding)."""
    ids, labels, pos = [], [], []
    for d_ids, d_labels in docs:
        d_ids = np.asarray(d_ids, dtype=np.int32)
        ids.append(d_ids)
        labels.append(np.asarray(d_labels, dtype=np.int32))
        pos.append(np.arange(len(d_ids), dtype=np.int32))
    n = sum(len(x) for x in ids)
    pad = seq_len - n
    if pad < 0:
        raise ValueError(f"bin holds {n} tokens > seq_len {seq_len}")
    if pad:
        ids.append(np.full(pad, pad_id, dtype=np.int32))
        labels.append(np.full(pad, IGNORE, dtype=np.int32))
        pos.append(np.arange(pad, dtype=np.int32))  # padding forms its own (fully masked) document
    row = {"input_ids": np.concatenate(ids), "labels": np.concatenate(labels), "position_ids": np.concatenate(pos)}
    return row, pad


def attention_pairs(position_ids) -> int:
    """Sum over the row's documents of length^2 (the padding tail counts as one): what per-document causal attention
    computes in a row is proportional to it (a dense S x S mask: S^2). Documents as attention.py splits them: a new
    one wherever a position does not follow the previous one by 1."""
    pos = np.asarray(position_ids)
    if not len(pos):
        return 0
    starts = np.flatnonzero(np.r_[True, pos[1:] != pos[:-1] + 1])
    lengths = np.diff(np.r_[starts, len(pos)])
    return int((lengths.astype(np.int64) ** 2).sum())


def iter_packed(bins: list[list[int]], get_doc: Callable[[int], tuple], seq_len: int,
                pad_id: int) -> Iterator[tuple[dict, int]]:
    """Rows for `bins`; documents inside a bin keep their original order."""
    for b in bins:
        yield packed_row((get_doc(i) for i in sorted(b)), seq_len, pad_id)


def pack(docs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[list[dict], int]:
    """Packed rows (lists) padded to seq_len; returns (rows, padding tokens). In-memory convenience."""
    bins = best_fit_decreasing([len(d[0]) for d in docs], seq_len)
    rows, padding = [], 0
    for row, pad in iter_packed(bins, lambda i: docs[i], seq_len, pad_id):
        rows.append({k: v.tolist() for k, v in row.items()})
        padding += pad
    return rows, padding
