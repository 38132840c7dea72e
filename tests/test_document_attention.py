"""Per-document attention (`sdpa_docs`, src/zerotune/attention.py) against transformers' dense block-causal mask.

For each family the repository trains (Llama with GQA, Qwen3 with q/k norms, Gemma 3 with sliding-window layers),
a packed row gives the same logits and the same gradients as `sdpa` with its dense mask, for documents from 1 token
to the whole row; changing one document moves no other document's logits; rows without packed documents (padded
batches, generation with a KV cache) run exactly as `sdpa`.
"""

from __future__ import annotations

import pytest
import torch

from zerotune.attention import NAME, DocumentBoundaryError, document_spans, register

register()


def _model(family: str, attn: str, window: int = 8):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                  attn_implementation=attn)
    torch.manual_seed(0)
    if family == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    else:  # 3 sliding : 1 global, a small window so that documents are longer than it
        common["num_hidden_layers"] = 4
        m = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=window, sliding_window_pattern=4,
                                               query_pre_attn_scalar=16))
        assert "sliding_attention" in m.config.layer_types
    return m.double()  # float64: the two kernels then agree to rounding, whatever the length


ROWS = {  # document lengths of one packed row (the padding tail is its own document, as data/packing.py writes it)
    "mixed": [7, 1, 12, 5, 1, 6],
    "ones": [1] * 16,
    "whole_row": [32],
    "long_and_tail": [29, 3],
}


def _row(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids[None], pos[None]


def _logits_and_grads(model, ids, pos):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("row", list(ROWS))
def test_logits_and_gradients_equal_the_dense_mask(family, row):
    ids, pos = _row(ROWS[row])
    dense, docs = _model(family, "sdpa"), _model(family, NAME)
    docs.load_state_dict(dense.state_dict())
    dense.train(), docs.train()
    ld, gd = _logits_and_grads(dense, ids, pos)
    lp, gp = _logits_and_grads(docs, ids, pos)
    assert (ld - lp).abs().max() < 1e-10, (family, row, (ld - lp).abs().max())
    assert gd.keys() == gp.keys() and len(gd) > 5
    for n in gd:
        assert torch.allclose(gd[n], gp[n], atol=1e-10, rtol=1e-9), (family, row, n, (gd[n] - gp[n]).abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_changing_one_document_moves_no_other(family):
    lens = [9, 14, 4, 5]
    ids, pos = _row(lens)
    model = _model(family, NAME).eval()
    changed = ids.clone()
    changed[0, 9:23] = torch.randint(1, 128, (14,), generator=torch.Generator().manual_seed(7))  # document 2 only
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        b = model(input_ids=changed, position_ids=pos, use_cache=False).logits[0]
    assert (a[9:23] - b[9:23]).abs().max() > 1e-3  # the probe did change its own document
    assert torch.equal(a[:9], b[:9]) and torch.equal(a[23:], b[23:])  # and nothing else, bit for bit


def test_gemma3_window_applies_inside_a_document():
    """A 20-token document with window 8: token 19 sees tokens 12..19 only. Changing token 5 moves nothing at 19 in
    a sliding-only model, while the dense mask agrees (checked above); a global layer would see it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention"], query_pre_attn_scalar=16, attn_implementation=NAME)
    model = Gemma3ForCausalLM(cfg).double().eval()
    ids, pos = _row([20])
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 128
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        b = model(input_ids=changed, position_ids=pos, use_cache=False).logits[0]
    assert (a[5:13] - b[5:13]).abs().max() > 1e-6  # inside the window of token 5
    assert torch.equal(a[13:], b[13:])  # 13 - 5 = 8: outside it


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rows_without_documents_run_as_sdpa(family):
    """A left-padded batch and greedy generation with a KV cache: one document per row, identical to sdpa."""
    dense, docs = _model(family, "sdpa").eval(), _model(family, NAME).eval()
    docs.load_state_dict(dense.state_dict())
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        a = dense(input_ids=ids, attention_mask=mask).logits
        b = docs(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(a[mask.bool()], b[mask.bool()])
        ga = dense.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        gb = docs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(ga, gb)


def test_spans_follow_transformers_rule():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_spans(pos) == [[(0, 3), (3, 4), (4, 6), (6, 8), (8, 9)], [(0, 9)]]
    ids = find_packed_sequence_indices(pos)
    for row, spans in zip(ids.tolist(), document_spans(pos)):
        assert [row[s] for s, _ in spans] == sorted(set(row))  # the same documents, in the same places


def test_no_position_ids_is_an_error_not_a_fallback():
    from zerotune.attention import document_attention

    class Layer:
        num_key_value_groups = 1

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(DocumentBoundaryError, match="without position_ids"):
        document_attention(Layer(), q, q, q, None, position_ids=None)
    with pytest.raises(DocumentBoundaryError, match="soft-caps"):
        document_attention(Layer(), q, q, q, None, position_ids=torch.arange(4)[None], softcap=30.0)


def test_a_new_batch_in_the_same_storage_gets_its_own_documents():
    """The spans are computed once per forward; a later batch whose position_ids sit at the same address with the
    same version (the allocator reuses freed memory; found by the golden-loss test, whose step 5 moved by 1.8%) must
    not be served the earlier row's documents."""
    import numpy as np

    dense, docs = _model("llama", "sdpa"), _model("llama", NAME)
    docs.load_state_dict(dense.state_dict())
    buf = np.zeros((1, 32), dtype=np.int64)
    for lens in ([7, 1, 12, 5, 1, 6], [16, 16], [32], [3, 29]):
        ids, pos = _row(lens)
        buf[:] = pos.numpy()
        shared = torch.from_numpy(buf)  # a new tensor object over the same memory, version 0 every time
        with torch.no_grad():
            a = dense(input_ids=ids, position_ids=pos, use_cache=False).logits
            b = docs(input_ids=ids, position_ids=shared, use_cache=False).logits
        assert (a - b).abs().max() < 1e-10, lens


def test_no_call_asks_for_enable_gqa(monkeypatch):
    """On a V100 (no flash kernel) and on CPU, SDPA's enable_gqa is taken only by the math kernel (torch sdp_utils:
    check_batch_size_and_num_heads_dense<false> for the memory-efficient kernel): training rows, a padded batch and
    every decode step of generation must reach SDPA without it, and still equal transformers' sdpa (found by the
    gpu-check's V100 emulation guard)."""
    import torch.nn.functional as F

    real, seen = F.scaled_dot_product_attention, []

    def spy(*a, **kw):
        seen.append(bool(kw.get("enable_gqa")))
        return real(*a, **kw)

    dense, docs = _model("qwen3", "sdpa").eval(), _model("qwen3", NAME).eval()
    docs.load_state_dict(dense.state_dict())
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = dense.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=5, do_sample=False)
        want_padded = dense(input_ids=ids, attention_mask=mask).logits
        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        got = docs.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=5, do_sample=False)
        got_padded = docs(input_ids=ids, attention_mask=mask).logits
        pos = torch.cat([torch.arange(4), torch.arange(6)])[None]
        docs(input_ids=ids[:1], position_ids=pos, use_cache=False)
    assert torch.equal(got, want)
    assert (got_padded - want_padded).abs().max() < 1e-10
    assert seen and not any(seen)


def test_training_on_cuda_stops_on_a_math_kernel_fallback_naming_the_call():
    """Issue 53 (3): the worker trains under attention.SdpaGuard(training_backends(on_cuda), strict=True): on CUDA the
    fused kernels only, and a call none takes is an error that names it, not a silent math kernel. Here (CPU) the
    memory-efficient kernel stands in for "a fused kernel that cannot take this call": CPU has none."""
    import pytest
    import torch
    import torch.nn.functional as F

    from zerotune.attention import FUSED, SdpaFallbackError, SdpaGuard, training_backends

    assert training_backends(True) == FUSED == ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")
    assert training_backends(False) == ()
    q = torch.randn(1, 4, 8, 16)
    with SdpaGuard(training_backends(False), strict=True):  # CPU: nothing restricted
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    orig = F.scaled_dot_product_attention
    with pytest.raises(SdpaFallbackError, match=r"no fused kernel \(EFFICIENT_ATTENTION\) takes .*q 1x4x8x16"):
        with SdpaGuard(("EFFICIENT_ATTENTION",), strict=True):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert F.scaled_dot_product_attention is orig  # restored after the error
    # the outermost guard rules: gpu-check's emulation (recording, math rerun) around the worker's strict one
    with SdpaGuard(("EFFICIENT_ATTENTION",)) as outer:
        with SdpaGuard(("EFFICIENT_ATTENTION",), strict=True):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert "math kernel for 1 call(s)" in outer.take()


def test_grouped_kv_without_a_mask_runs_with_its_heads_repeated_where_no_fused_kernel_takes_gqa(monkeypatch):
    """On a V100 or T4 only the math kernel takes enable_gqa (FlashAttention needs sm80+), and transformers passes it
    whenever no mask is given (DPO's unmasked pairs; an unpacked row under `sdpa`). Under the strict guard such a call
    runs with K/V repeated to the query's heads, the answer unchanged, instead of stopping training. Here a stand-in
    SDPA refuses enable_gqa the way CUDA's fused kernels do on sm70 ("No available kernel")."""
    import pytest
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from zerotune.attention import SdpaFallbackError, SdpaGuard

    real = F.scaled_dot_product_attention

    def sm70(*args, **kw):
        if kw.get("enable_gqa") or kw.get("attn_mask") is not None:  # what a V100's fused kernel cannot take here
            raise RuntimeError("No available kernel. Aborting execution.")
        with sdpa_kernel([SDPBackend.MATH]):  # the CPU stand-in for the memory-efficient kernel
            return real(*args, **kw)

    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    want = real(q, k, v, is_causal=True, enable_gqa=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sm70)
    with SdpaGuard(("MATH",), strict=True) as guard:
        got = F.scaled_dot_product_attention(q, k, value=v, is_causal=True, enable_gqa=True)
        assert guard.take() is None
        with pytest.raises(SdpaFallbackError, match="enable_gqa=True"):  # a call no kernel takes at all still stops
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), enable_gqa=True)
    torch.testing.assert_close(got, want)
