"""Attention for packed rows without FlashAttention 2: each document attends to itself only.

Why it exists. A packed row holds many short documents (chat data: p50 389 tokens, p99 1,646 in the prepare
benchmark). transformers turns the restarting `position_ids` into a dense (micro, 1, S, S) block-causal mask for
`sdpa` (masking_utils.py find_packed_sequence_indices, PR #39194); SDPA given a mask has no `is_causal` path, so the
memory-efficient kernel (the only fused one a V100 or T4 has) computes every tile of the S x S scores and the mask
then throws almost all of them away: at 16K rows of ~1K-token documents, ~32x the work of attending within each
document. FlashAttention 2 does the per-document version (varlen), but not below sm80 (flash-attention #891).

What runs. `sdpa_docs` is registered in transformers' AttentionInterface (and AttentionMaskInterface), so the model,
Liger, gradient checkpointing and ZeRO-3 are unchanged: each decoder layer calls `document_attention` where it
would call SDPA. It reads the document boundaries from the packed `position_ids` with transformers' own rule (a new
document starts wherever the position does not follow the previous one by 1), and calls
`scaled_dot_product_attention(is_causal=True)` once per document. On a V100/T4 that is the memory-efficient kernel
on its causal path (it skips the tiles above the diagonal); on CPU torch's flash-attention CPU kernel. No mask is
built, so the S x S mask's memory is gone too.

Why a loop over documents and not PyTorch's variable-length kernel. `aten::_efficient_attention_forward` takes
`cu_seqlens` and would be one kernel call, but it is a private CUDA-only op: CPU (this repository's CI) could not
run the path the V100 runs, and its backward is reached only through nested tensors (torch/nested/_internal/
sdpa.py), unverified on sm70. The loop uses only the public SDPA API, runs the same code on CPU and GPU, and costs
one kernel launch per document per layer (~40 documents per 16K row: ~0.1 s of host time per 8B micro-step,
hidden behind the GPU's work); the documents are cut out with split, whose backward is one concatenation.
bench/bench_attention.py measures what it saves.

K/V are repeated to all query heads (as transformers' sdpa does whenever it passes a mask): SDPA's `enable_gqa`
is supported by the CUDA flash and cuDNN kernels and CPU math only, so on a V100 (no flash) and on CPU it would
drop to the math kernel, which materialises d x d scores (torch sdp_utils.cpp / sdp_utils_cpp.cpp:
check_batch_size_and_num_heads_dense<false> for the memory-efficient and CPU flash kernels).

Gemma 3's sliding-window layers: the window applies inside a document (transformers ANDs the window with the packed
mask). A document no longer than the window is plain causal; a longer one is attended in query blocks of `window`
rows against the 2 x window keys they can see, with a small banded mask, so no d x d tensor is built.

Inputs without packed documents take transformers' own `sdpa_attention_forward` unchanged: a padded batch (a 2-D
padding mask: unpacked micro-batches, batched generation) or a KV cache (generation's decode steps). Those rows hold
one document each, so there is nothing to split; the mask function below builds their SDPA mask exactly as `sdpa`
would. Anything else the layer cannot be split on (no position_ids, a soft-capped or bidirectional model) is an
error that says why, never a silent switch of kernel.
"""

from __future__ import annotations

import os
import traceback

NAME = "sdpa_docs"  # train.attention value; the model's config._attn_implementation


class DocumentBoundaryError(RuntimeError):
    """A packed forward whose document boundaries cannot be read: a bug or an unsupported model, not a user error."""


def document_spans(position_ids) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each document: a document starts at 0 and wherever a position is not the
    previous one + 1 (transformers' find_packed_sequence_indices, so both kernels split rows identically).
    One host transfer per call; `_spans` caches it for the layers of one forward and its recompute."""
    import torch

    pos = position_ids.detach().to("cpu", torch.long)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    out = []
    n = pos.shape[1]
    for row in starts:
        s = torch.nonzero(row).flatten().tolist()
        out.append(list(zip(s, s[1:] + [n])))
    return out


_last: dict = {}


def _spans(position_ids, batch: int, q_len: int):
    """document_spans for this forward's position_ids, computed once for all its layers (and the recompute of
    gradient checkpointing, which passes the same tensor object). Keyed on the object itself, held here so that a
    later batch cannot take its place: a storage address is reused by the next batch's tensor, an object is not."""
    if position_ids is None:
        raise DocumentBoundaryError(
            f"attention {NAME}: the layer was called without position_ids, so the packed row's document boundaries "
            "cannot be read. This model family does not pass position_ids to its attention; train it with "
            "train.attention=sdpa (dense block-causal mask) and report the model type.")
    if position_ids.shape[-1] != q_len:
        raise DocumentBoundaryError(f"attention {NAME}: position_ids cover {position_ids.shape[-1]} positions, the "
                                    f"queries {q_len}: the document boundaries cannot be matched to the rows")
    if _last.get("tensor") is not position_ids or _last.get("version") != position_ids._version:
        rows = position_ids if position_ids.shape[0] == batch else position_ids.expand(batch, -1)
        _last.update(tensor=position_ids, version=position_ids._version, spans=document_spans(rows))
    return _last["spans"]


def _attend(q, k, v, window: int | None, dropout: float, scale: float | None):
    """Causal attention of one document (1, H, d, D), with a sliding window of `window` keys if given."""
    import torch
    import torch.nn.functional as F

    d = q.shape[2]
    if window is None or d <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale, is_causal=True)
    # query block [c, c + w) sees keys (i - w, i] for each row i: all inside [c - w + 1, c + w)
    w = window
    rows = torch.arange(w, device=q.device)[:, None]
    parts = []
    for c, qc in zip(range(0, d, w), q.split(w, 2)):  # keys overlap between blocks: sliced, within the document
        lo, hi = max(0, c - w + 1), min(d, c + w)
        qi = rows[: qc.shape[2]] + c
        kj = torch.arange(lo, hi, device=q.device)[None, :]
        mask = (kj <= qi) & (kj > qi - w)
        parts.append(F.scaled_dot_product_attention(qc, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask,
                                                    dropout_p=dropout, scale=scale))
    return torch.cat(parts, dim=2)


def document_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, position_ids=None, **kwargs):
    """transformers' attention interface: query (B, Hq, S, D), key/value (B, Hkv, S, D) -> ((B, S, Hq, D), None)."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if attention_mask is not None or query.shape[2] != key.shape[2]:
        # a padded batch or a KV cache: one document per row, SDPA as attn_implementation="sdpa" runs it, except
        # that no call asks for enable_gqa (transformers sets it whenever no mask is given; on sm70 and CPU only
        # the math kernel takes it): a decode step packs the query heads onto their K/V head instead
        if attention_mask is None and query.shape[2] == 1 and getattr(module, "num_key_value_groups", 1) > 1:
            return _decode_step(module, query, key, value, dropout, scaling)
        if attention_mask is None and getattr(module, "num_key_value_groups", 1) > 1:
            groups = module.num_key_value_groups
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
            module = _OneGroup(module)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, position_ids=position_ids, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise DocumentBoundaryError(f"attention {NAME}: this model soft-caps or biases its attention scores, which "
                                    "SDPA cannot do; use train.attention=eager")
    batch, _, q_len, _ = query.shape
    spans = _spans(position_ids, batch, q_len)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # keep the fused kernels eligible (docstring)
    # split, not sliced: the backward of a slice writes into a zero tensor the size of the whole input, once per
    # document (40 documents x 3 tensors of a 16K row per layer at 8B: ~60 GiB of memory traffic), where the
    # backward of a split is one concatenation
    rows = []
    for qb, kb, vb, docs in zip(query.split(1), key.split(1), value.split(1), spans):
        lengths = [e - s for s, e in docs]
        rows.append(torch.cat([_attend(q, k, v, sliding_window, dropout, scaling) for q, k, v in zip(
            qb.split(lengths, 2), kb.split(lengths, 2), vb.split(lengths, 2))], dim=2))
    out = rows[0] if batch == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


class _OneGroup:
    """The layer as sdpa_attention_forward sees it once K/V already have every query head: no grouping left."""
    num_key_value_groups = 1

    def __init__(self, module):
        self.is_causal = getattr(module, "is_causal", True)
        self.layer_idx = getattr(module, "layer_idx", None)


def _decode_step(module, query, key, value, dropout: float, scale: float | None):
    """One new token against the cache, no mask: the n_rep query heads of each K/V head become n_rep query rows of
    that head (transformers' pack_gqa), one non-causal SDPA call with no K/V copy and no enable_gqa."""
    import torch.nn.functional as F

    b, h, _, d = query.shape
    groups = module.num_key_value_groups
    q = query.reshape(b, h // groups, groups, d)
    out = F.scaled_dot_product_attention(q, key, value, dropout_p=dropout, scale=scale)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def document_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  attention_mask=None, config=None, **kwargs):
    """transformers' mask interface for `sdpa_docs`: no mask for a full row without padding or cache (the
    attention reads the documents from position_ids); otherwise the mask `sdpa` would get."""
    from transformers.masking_utils import sdpa_mask

    if getattr(config, "use_bidirectional_attention", False):
        raise DocumentBoundaryError(f"attention {NAME}: this model attends bidirectionally "
                                    "(config.use_bidirectional_attention); per-document causal attention does not apply")
    no_padding = attention_mask is None or bool(attention_mask.all())
    if no_padding and q_length == kv_length and not q_offset and not kv_offset:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, config=config, **kwargs)


def register() -> None:
    """Make `attn_implementation="sdpa_docs"` loadable in this process (idempotent). Every process that loads a
    model with it calls this first: the workers, finalize's verify, the benchmarks and tests."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, document_attention)
    AttentionMaskInterface.register(NAME, document_mask)


def load_name(attention: str) -> str:
    """The attn_implementation to pass to from_pretrained, registering zerotune's own first."""
    if attention == NAME:
        register()
    return attention


# ---------------------------------------------------------------------------------------------
# Which SDPA kernels may run
# ---------------------------------------------------------------------------------------------

NO_KERNEL = ("No available kernel", "No viable backend")  # no enabled SDPA backend takes the call (CUDA, CPU)
# What training allows on CUDA: the fused kernels, never the math one (it materialises S x S scores: at 16K rows
# 32 heads x 16K x 16K fp32 per layer). On a V100 or T4 only the memory-efficient one exists.
FUSED = ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")


def training_backends(on_cuda: bool) -> tuple[str, ...]:
    """The SDPA backends a training worker runs under (train/worker.py): the fused ones on CUDA; on CPU none is
    restricted (torch's CPU flash kernel or math, both without a GPU's memory to lose)."""
    return FUSED if on_cuda else ()


class SdpaFallbackError(RuntimeError):
    """Training asked SDPA for a call no fused kernel takes (it would run the math kernel's S x S scores)."""


class SdpaGuard:
    """SDPA limited to `backends` (SDPBackend names; none: a no-op). A call none of them takes is recorded (site,
    shapes, flags) and rerun on the math kernel, take() returning what was recorded since the last take; `strict`:
    it raises SdpaFallbackError naming the call instead. The outermost guard rules: one entered inside another
    (the training worker inside gpu-check's emulation) changes nothing."""
    _active = False

    def __init__(self, backends: tuple[str, ...] = (), strict: bool = False):
        self.backends, self.strict, self.calls, self._saved = tuple(backends), strict, {}, None

    def __enter__(self):
        if not self.backends or SdpaGuard._active:
            return self
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        orig = F.scaled_dot_product_attention
        kernel = sdpa_kernel([getattr(SDPBackend, b) for b in self.backends])
        kernel.__enter__()

        def fused(*args, **kw):
            try:
                return orig(*args, **kw)
            except RuntimeError as e:
                if not any(m in str(e) for m in NO_KERNEL):
                    raise
            if kw.get("enable_gqa"):
                # On CUDA only FlashAttention (sm80+) and the math kernel take grouped K/V (torch/nn/functional.py,
                # scaled_dot_product_attention's enable_gqa note). transformers asks for it whenever no mask is passed
                # (integrations/sdpa_attention.py use_gqa_in_sdpa: DPO's unmasked pairs, an unpacked row under
                # `sdpa`); on a V100 or T4 the heads are repeated instead, as transformers does whenever a mask is
                # given, so the memory-efficient kernel takes the call.
                a, k = repeat_kv_heads(args, kw)
                try:
                    return orig(*a, **k)
                except RuntimeError as e:
                    if not any(m in str(e) for m in NO_KERNEL):
                        raise
            return None

        def sdpa(*args, **kw):  # transformers and attention.py look the function up at each call
            out = fused(*args, **kw)
            if out is None:
                key, text = describe_sdpa_call(args, kw)
                if self.strict:
                    raise SdpaFallbackError(
                        f"SDPA: no fused kernel ({'/'.join(self.backends)}) takes {text}; the math kernel would "
                        "build its S x S scores. A shape, dtype or mask this GPU's kernels do not support: report it "
                        "with this line.") from None
                self.calls.setdefault(key, [0, text])[0] += 1
                with sdpa_kernel([SDPBackend.MATH]):
                    return orig(*args, **kw)
            return out

        self._saved = (F, orig, kernel)
        F.scaled_dot_product_attention = sdpa
        SdpaGuard._active = True
        return self

    def __exit__(self, *exc):
        if self._saved:
            F, orig, kernel = self._saved
            F.scaled_dot_product_attention = orig
            kernel.__exit__(None, None, None)
            self._saved = None
            SdpaGuard._active = False
        return False

    def take(self) -> str | None:
        if not self.calls:
            return None
        n = sum(c for c, _ in self.calls.values())
        out = (f"SDPA fell back to the math kernel for {n} call(s) ({'/'.join(self.backends)} could not take them): "
               + "; ".join(f"{c} x {t}" for c, t in self.calls.values()))
        self.calls = {}
        return out


def repeat_kv_heads(args, kw) -> tuple[tuple, dict]:
    """An SDPA call's grouped K/V repeated to the query's heads (dim -3), enable_gqa dropped: the same attention."""
    names = ("query", "key", "value")
    qkv = [args[i] if i < len(args) else kw[n] for i, n in enumerate(names)]
    groups = qkv[0].shape[-3] // qkv[1].shape[-3]
    qkv[1:] = [t.repeat_interleave(groups, dim=-3) for t in qkv[1:]]
    rest = {k: v for k, v in kw.items() if k not in names and k != "enable_gqa"}
    return (*qkv, *args[3:]), rest


def describe_sdpa_call(args, kw) -> tuple[tuple, str]:
    """(key, text) of one SDPA call: its caller outside torch and this module, shapes, dtype, mask and flags. The
    key leaves out the lengths, so a generation's decode steps count as one kind of call."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    p = {**dict(zip(names, args)), **kw}
    q, k, mask = p["query"], p["key"], p.get("attn_mask")
    site = "?"
    for f in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in f.filename:  # [:-2]: this function and the wrapper that called it
            site = f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno}"
            break
    flags = f"is_causal={bool(p.get('is_causal'))}, enable_gqa={bool(p.get('enable_gqa'))}"
    text = (f"{site} (q {'x'.join(map(str, q.shape))}, k {'x'.join(map(str, k.shape))} "
            f"{str(q.dtype).removeprefix('torch.')}, {'mask' if mask is not None else 'no mask'}, {flags})")
    return (site, q.shape[1], k.shape[1], q.shape[2] == 1, mask is None, flags, str(q.dtype)), text
