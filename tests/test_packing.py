"""Best-fit-decreasing packing, and packed forward == per-document forward (block-causal via position_ids)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from zerotune.data.packing import best_fit_decreasing, pack
from zerotune.data.tokenize import IGNORE


def _check_bins(bins, lengths, cap):
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))  # every document exactly once
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)  # capacity respected
    assert all(b for b in bins)


def test_bfd_small_exact():
    lengths = [5, 4, 3, 3, 2, 2, 1]
    bins = best_fit_decreasing(lengths, 10)
    _check_bins(bins, lengths, 10)
    assert [sorted(b) for b in bins] == [[0, 1, 6], [2, 3, 4, 5]]  # two full bins: optimal here


def test_bfd_exact_fit_and_edge_cases():
    assert best_fit_decreasing([], 8) == []
    assert best_fit_decreasing([8, 8], 8) == [[0], [1]]
    bins = best_fit_decreasing([3, 5, 5, 3], 8)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="document 1 has 9 tokens > capacity 8"):
        best_fit_decreasing([2, 9], 8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfd_random_capacity_all_placed_efficiency(seed):
    rng = random.Random(seed)
    cap = 4096
    # chat-like lengths: mostly short, a long tail, some at the cap (truncated)
    lengths = [min(cap, int(rng.lognormvariate(6.0, 0.9)) + 16) for _ in range(3000)]
    bins = best_fit_decreasing(lengths, cap)
    _check_bins(bins, lengths, cap)
    lower = math.ceil(sum(lengths) / cap)
    assert len(bins) <= lower + 1  # within one bin of the trivial lower bound
    assert sum(lengths) / (len(bins) * cap) >= 0.98
    assert best_fit_decreasing(lengths, cap) == bins  # deterministic


def test_pack_rows_layout():
    docs = [([1, 2, 3], [IGNORE, 2, 3]), ([4, 5, 6, 7, 8], [IGNORE, IGNORE, 6, 7, 8]), ([9, 10], [IGNORE, 10])]
    rows, padding = pack(docs, seq_len=8, pad_id=0)
    assert len(rows) == 2 and padding == 6
    # best fit: the 3-token doc fills the 5-token doc's bin exactly; docs keep their original order in a bin
    assert rows[0] == {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "labels": [IGNORE, 2, 3, IGNORE, IGNORE, 6, 7, 8],
                       "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]}
    # padding is its own fully masked "document" with restarting positions
    assert rows[1] == {"input_ids": [9, 10, 0, 0, 0, 0, 0, 0], "labels": [IGNORE, 10] + [IGNORE] * 6,
                       "position_ids": [0, 1, 0, 1, 2, 3, 4, 5]}


# ---- packed forward == per-document forward ---------------------------------------------------------

def _tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      initializer_range=0.1, tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return model


def _packed_batch(lens=(7, 12, 5), seq_len=32):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 256, (n,), generator=g) for n in lens]
    ids = torch.cat(docs + [torch.zeros(seq_len - sum(lens), dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.arange(seq_len - sum(lens))])
    return docs, ids[None], pos[None]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_per_document(attn):
    model = _tiny_llama(attn)
    docs, ids, pos = _packed_batch()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        start = 0
        for d in docs:
            alone = model(input_ids=d[None], position_ids=torch.arange(len(d))[None], use_cache=False).logits[0]
            assert torch.allclose(packed[start:start + len(d)], alone, atol=1e-5, rtol=0), \
                (attn, (packed[start:start + len(d)] - alone).abs().max())
            start += len(d)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_per_document_loss(attn):
    """Token-summed loss of a packed row == sum over documents (first label of each doc is IGNORE)."""
    model = _tiny_llama(attn)
    docs, ids, pos = _packed_batch()
    labels = torch.full_like(ids, IGNORE)
    start = 0
    for d in docs:
        labels[0, start + 1:start + len(d)] = d[1:]
        start += len(d)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        packed = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE, reduction="sum")
        per_doc = sum(torch.nn.functional.cross_entropy(model(input_ids=d[None], use_cache=False).logits[0, :-1], d[1:],
                                                        reduction="sum") for d in docs)
    assert torch.allclose(packed, per_doc, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_with_kv_cache_documents_attend_across_boundaries(attn):
    """Documents why training sets use_cache=False: with a cache (the inference default) transformers builds a plain
    causal mask, so the second packed document sees the first and its logits differ from the per-document ones."""
    model = _tiny_llama(attn)
    docs, ids, pos = _packed_batch()
    with torch.no_grad():
        cached = model(input_ids=ids, position_ids=pos, use_cache=True).logits[0]
        d = docs[1]
        alone = model(input_ids=d[None], position_ids=torch.arange(len(d))[None], use_cache=False).logits[0]
        first = model(input_ids=docs[0][None], use_cache=False).logits[0]
    s = len(docs[0])
    assert torch.allclose(cached[:s], first, atol=1e-5)  # the first document is unaffected either way
    assert (cached[s:s + len(d)] - alone).abs().max() > 1e-3  # contamination across the boundary
