"""The planner's attention-time model per backend (issue 19 item 5) and the seq_len x micro-batch it recommends.

Packed rows give SDPA a dense (micro, 1, S, S) mask: no is_causal path, every key tile visited (2x causal);
flash-attn's varlen path attends within documents only. Arithmetic at 8B size on the meta device."""

from __future__ import annotations

import json

import pytest

from zerotune.config import load_recipe
from zerotune.plan import attention_kind, compute_plan


@pytest.mark.parametrize("attention, packing, micro, kind", [
    ("sdpa", True, 1, "dense"), ("sdpa", False, 1, "causal"), ("sdpa", False, 2, "dense"),  # padded batch
    ("eager", True, 1, "dense"), ("eager", False, 1, "dense"), ("flash_attention_2", True, 4, "varlen"), ("flash_attention_2", False, 2, "varlen"),
])
def test_attention_kind_per_backend(attention, packing, micro, kind):
    assert attention_kind(attention, packing, micro) == kind


def _with_docs(tmp_path, p50, p99, overrides=()):
    r = load_recipe("llama8b_zero3", [f"output_dir={tmp_path}", *overrides])
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / "manifest.json").write_text(json.dumps(
        {"stage": "data", "doc_length": {"min": 50, "p50": p50, "p90": p99 // 2, "p99": p99, "max": 16384}}))
    return r


def test_dense_mask_costs_more_than_causal_at_8b_on_v100():
    packed = compute_plan(load_recipe("llama8b_zero3"))["time"]
    unpacked = compute_plan(load_recipe("llama8b_zero3", ["data.packing=false"]))["time"]
    assert packed["attention_kind"] == "dense" and unpacked["attention_kind"] == "causal"
    assert packed["flops_attention"] == 2 * unpacked["flops_attention"]  # documents unknown: as long as a row
    assert packed["seconds_per_step"] > unpacked["seconds_per_step"]
    # 8 x V100 at 35% MFU, 16K rows: attention is ~2.2e18 of ~6.2e18 FLOPs per step
    assert 0.3 < packed["flops_attention"] / packed["flops_per_step"] < 0.4


def test_modelled_mask_cost_moves_the_recommendation_to_shorter_rows(tmp_path):
    """~1.4K-token documents (p99 3K) packed into 16K rows: a 4K row does a quarter of the masked attention, so
    the planner recommends it; varlen attention (A100, flash-attn) costs the same at any row length and keeps
    the recipe's own."""
    v100 = compute_plan(_with_docs(tmp_path, 1400, 3000))
    rec, own = v100["recommended"], next(o for o in v100["options"] if o["recipe"])
    assert own["fits"] and rec["seq_len"] == 4096 and rec["seq_len"] < own["seq_len"]
    assert rec["seconds_per_step"] < own["seconds_per_step"]
    a100 = compute_plan(_with_docs(tmp_path, 1400, 3000), gpu="a100-80gb")
    assert a100["time"]["attention_kind"] == "varlen"
    assert a100["recommended"]["recipe"]


def test_without_document_lengths_the_recipe_choice_stands():
    p = compute_plan(load_recipe("llama8b_zero3"))
    assert p["recommended"]["recipe"]  # seq_len >= p99 cannot be checked before `prepare`: no shorter rows
