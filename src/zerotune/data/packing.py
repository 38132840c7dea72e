"""Best-fit-decreasing packing of documents into fixed-length sequences.

Positions restart at 0 for every document. With `use_cache=False` transformers
turns restarting `position_ids` into a block-causal mask (SDPA, eager) or
varlen boundaries (FlashAttention 2), so packed documents never attend to each
other; tests/test_packing.py checks packed logits equal per-document logits.
"""

from __future__ import annotations

import bisect

from .tokenize import IGNORE


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices; each bin's total length <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"document {i} has {n} tokens > capacity {capacity}; truncate or drop it first")
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


def pack(docs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[list[dict], int]:
    """Packed rows {input_ids, labels, position_ids} padded to seq_len; returns (rows, padding tokens)."""
    bins = best_fit_decreasing([len(d[0]) for d in docs], seq_len)
    rows, padding = [], 0
    for b in bins:
        ids, labels, pos = [], [], []
        for i in sorted(b):
            d_ids, d_labels = docs[i]
            ids += d_ids
            labels += d_labels
            pos += list(range(len(d_ids)))
        pad = seq_len - len(ids)
        padding += pad
        ids += [pad_id] * pad
        labels += [IGNORE] * pad
        pos += list(range(pad))  # padding forms its own (fully masked) document
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return rows, padding
