"""FLOPs per optimizer step, by what the attention kernel computes (issue 40).

A packed row of short documents costs attention in proportion to the sum of its documents' d^2 when the kernel
attends per document (sdpa_docs, attention.py; flash_attention_2's varlen), and to S^2 when SDPA gets the dense
block-causal mask. The prepared data measures the per-document span (data manifest attention_span); before
`make data`, ASSUMED_ATTENTION_SPAN stands in, and the plan says which it used.
"""

from __future__ import annotations

from ..config import Recipe
from .memory import attention_has_mask, pair_rows_padded


def attention_kind(attention: str, packing: bool, micro: int, padded: bool | None = None) -> str:
    """What the attention kernel computes per row. "per_document": sdpa_docs (attention.py) on packed rows, SDPA's
    causal kernel once per document; "varlen": flash_attention_2 with sequence boundaries; both compute each
    document's own triangle (sum of d^2 / 2 per row). "causal": SDPA/eager with no mask: SDPA takes its is_causal
    path and skips the upper triangle (unpacked rows; sdpa_docs on them: one document per row). "dense": SDPA/eager
    given a (micro, 1, S, S) mask (packed rows under `sdpa`, padded micro-batches): no is_causal, so the
    memory-efficient kernel visits every key tile of all S x S, twice the causal work (transformers 5.23
    integrations/sdpa_attention.py:159 `is_causal = q_length > 1 and attention_mask is None and is_causal`; torch
    2.13 nn/functional.py:6471, SDPA refuses attn_mask together with is_causal)."""
    if attention == "flash_attention_2":
        return "varlen"
    if attention == "eager":
        return "dense"  # eager always multiplies out all S x S scores and masks them afterwards
    if attention_has_mask(attention, packing, micro, padded):
        return "dense"
    return "per_document" if attention == "sdpa_docs" and packing else "causal"


# The span a token attends over with per-document attention (sum of d^2 / sum of d, attention_span in the data
# manifest) before `make data` has measured it: 1,024 tokens. bench_data.py's chat set (log-normal turns, p50 389,
# p99 1,646 tokens with the Llama-3.1 template) measures 786 at 2K-16K rows, padding included (bench/bench_attention.py
# prints it); rounded up to a power of two because users' chats with long system prompts or tool schemas run longer.
ASSUMED_ATTENTION_SPAN = 1024


def attention_span(docs: dict | None, seq: int) -> tuple[float, str]:
    """(span, where it comes from) for per-document attention at rows of `seq` tokens: the prepared data's own when
    it was prepared at this seq_len (docs: _doc_lengths), else the assumption (capped by the row)."""
    if docs and docs.get("attention_span") and docs.get("seq_len") == seq:
        return float(docs["attention_span"]), "the prepared data's documents (data manifest attention_span)"
    return float(min(seq, ASSUMED_ATTENTION_SPAN)), ("assumed until `make data` measures your documents; "
                                                     "bench chats: 786, rounded up")


def flops_per_step(r: Recipe, shape, seq, micro: int, attention: str, docs: dict | None,
                   row: float | None = None) -> dict:
    """FLOPs per optimizer step, counting all executed FLOPs.

    Attention per token per layer, forward: 2 x S x q_dim for causal (QK^T and PV over half the matrix),
    4 x S x q_dim with a dense mask (the whole matrix), 2 x D x q_dim per document (varlen, per_document), where D is
    the token-weighted span sum(d^2) / sum(d) (attention_span). x3 for forward + backward, x4 with recompute.
    Unpacked rows hold one document each, so S is the document length there too (the prepared data's median).
    row: DPO's tokens per row as they run (Target.row_tokens): the global batch counts 2 x seq_len per pair, the
    bound; a step processes 2 x row per pair, each row one document of row tokens."""
    T, N, L = r.train.global_batch_tokens, shape.n_params, shape.layers
    if r.pairs and row:
        T = T * row / seq
    ckpt = r.train.gradient_checkpointing
    dense = 6 * N * T
    recompute = 2 * N * T if ckpt else 0
    kind = attention_kind(attention, r.data.packing, micro, padded=pair_rows_padded(shape, attention) if r.pairs else None)
    doc = row if r.pairs and row else min(seq, docs["p50"]) if docs and docs.get("p50") else seq
    span_of, span_from = (attention_span(docs, seq) if kind in ("varlen", "per_document") else (None, None))
    span = {"varlen": 2 * (span_of or 0), "per_document": 2 * (span_of or 0), "causal": 2 * (seq if r.data.packing else doc),
            "dense": 4 * (seq if r.data.packing else doc)}[kind]
    attention = (4 if ckpt else 3) * span * shape.q_dim * L * T
    return {"tokens_per_step": T, "flops_per_step": dense + recompute + attention, "flops_dense": dense,
            "flops_recompute": recompute,
            "flops_attention": attention, "attention_kind": kind, "attention_span": span_of,
            "attention_span_from": span_from}
