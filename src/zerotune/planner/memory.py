"""Per-GPU training memory for every model family zerotune trains (families.py: Llama, Qwen3, Gemma 3): model
states, DeepSpeed buffers, activations.

Model states come from DeepSpeed's own estimator (so `zerotune plan` and DeepSpeed's docs agree);
everything the estimator leaves out is modelled here, term by term, so the breakdown sums to the
predicted peak. The activation terms mirror what transformers' code for each family saves for backward
(modeling_llama.py, modeling_qwen3.py: q/k norms, modeling_gemma3.py: four fp32 norms per layer, q/k norms,
sliding-window layers); they are validated on CPU in tests/test_activation_memory.py (measured with
saved_tensors_hooks, exact for every family). Terms that hooks cannot see (backward transients, the persistent attention mask,
Liger's fused loss buffers) are modelled from the kernels' source and covered by the margin.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..errors import UserError
from ..families import FAMILIES, of_config
from . import calibration

GiB = 1024 ** 3


@dataclass(frozen=True)
class ModelShape:
    n_params: int
    largest_layer_params: int  # as DeepSpeed counts it: parameters owned directly by one module
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    config_path: str
    family: str = "llama"  # a key of families.FAMILIES
    layer_types: tuple = ()  # per layer "full_attention" / "sliding_attention"; () = all full
    sliding_window: int | None = None
    tied: bool = False
    # per module owning parameters (in registration order, the forward's for these models), its own parameters'
    # numels: ZeRO-3 gathers those above stage3_param_persistence_threshold, module by module (planner/time.py)
    module_params: tuple = ()

    def zero3_modules(self, zero: dict | None) -> tuple[tuple, int]:
        """(numel each module ZeRO-3 gathers moves, reduce_bucket_size) under a resolved zero_optimization: a
        module's parameters above stage3_param_persistence_threshold (DeepSpeed keeps those at or under it
        resident: parameter_offload.py, numel <= threshold)."""
        t = zero_number(zero, "stage3_param_persistence_threshold", self.hidden)
        numels = tuple(n for n in (sum(x for x in own if x > t) for own in self.module_params) if n)
        return numels, zero_number(zero, "reduce_bucket_size", self.hidden)

    @property
    def fam(self):
        return FAMILIES[self.family]

    @property
    def sliding_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layer_types)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@functools.lru_cache(maxsize=16)
def shape_of(path: str) -> ModelShape:
    """The shape of the model a config.json describes, built on the meta device (cached per path)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    family = of_config(path)  # an architecture zerotune does not know: one message, before anything is built
    cfg = AutoConfig.from_pretrained(path)
    # Meta device: exact parameter count at no memory cost (8B: 8,030,261,248).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())  # tied weights once
    owned = [tuple(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    largest = max(sum(o) for o in owned)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer_types = tuple(getattr(cfg, "layer_types", None) or ())
    sliding = getattr(cfg, "sliding_window", None) if "sliding_attention" in layer_types else None
    return ModelShape(total, largest, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                      getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim,
                      cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, path, family.name,
                      layer_types, sliding, bool(getattr(cfg, "tie_word_embeddings", False)),
                      tuple(o for o in owned if o))


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------

def attention_has_mask(attention: str, packing: bool, micro: int, padded: bool | None = None) -> bool:
    # Packed rows (position_ids restarting at 0) or padded micro-batches give sdpa/eager a dense
    # (micro, 1, S, S) mask; flash_attention_2 uses varlen sequence boundaries instead, and sdpa_docs
    # (attention.py) splits packed rows by document without a mask: only a padded batch gives it one. Unpacked
    # data with micro-batch > 1 is padded (length-grouped), unless the caller says otherwise.
    if padded is None:
        padded = micro > 1 and not packing
    if attention == "sdpa_docs":
        return bool(padded)
    return attention != "flash_attention_2" and (packing or padded)


def pair_rows_padded(m: ModelShape, attention: str) -> bool | None:
    """How DPO's right-padded pair rows reach attention_has_mask. No mask (False): preference/objective.py passes none
    and SDPA runs is_causal. Except a model with sliding-window layers under sdpa or eager: transformers builds those
    layers a (rows, 1, S, S) mask once a row reaches the window (masking_utils.py sliding_window_causal_mask_function,
    the causal shortcut skipped at kv_length >= window); None: the padded micro-batch's default, a mask."""
    return None if m.sliding_layers and attention in ("sdpa", "eager") else False


def sliding_block_mask_elements(seq: int, window: int) -> int:
    """sdpa_docs on a sliding-window layer (attention.py _attend): a document longer than the window is attended
    in query blocks of `window` rows against the keys they can see, each with its own (rows x keys) mask, which
    SDPA converts to the query dtype and saves for backward. Counted for one document spanning the whole row (the
    worst case: shorter documents need fewer or no blocks)."""
    if seq <= window:
        return 0
    total = 0
    for c in range(0, seq, window):
        total += min(window, seq - c) * (min(seq, c + window) - max(0, c - window + 1))
    return total


def activation_bytes(m: ModelShape, micro: int, seq: int, dtype_bytes: int, attention: str = "sdpa",
                     checkpointing: bool = True, packing: bool = False, liger: bool = False,
                     padded: bool | None = None, residual_bytes: int | None = None, fused_loss: bool = False) -> dict:
    """Bytes of tensors saved for backward (deduplicated by storage), per rank, for one micro-batch.

    attention: "sdpa" = a fused kernel that keeps no S x S matrix (CUDA memory-efficient on V100/T4;
    on CPU, torch 2.13 picks its flash-attention CPU kernel, which saves the same tensors);
    "flash_attention_2" = the same without a mask; "eager" = materialised S^2 scores per head.
    residual_bytes: dtype of the residual stream when it differs from the matmuls' (QLoRA: peft's
    prepare_model_for_kbit_training leaves fp32 embeddings, so the stream between layers is fp32).
    fused_loss: the loss saves no log-softmax (DPO's fused loss, preference_loss_bytes), as with Liger.
    The family (m.family) decides the norms (Llama-style or Gemma's fp32 (1 + w) norm, 2 or 4 per layer,
    q/k norms) and which layers slide (Gemma 3: a sliding-window layer at seq >= its window needs a mask).
    Returns the parts and `saved_peak`, the most bytes alive at once (end of forward without
    checkpointing; with it, the largest of end of forward and each layer's recompute in backward).
    """
    e, b, S, h, I = dtype_bytes, micro, seq, m.hidden, m.intermediate
    res = residual_bytes or e
    T = b * S  # tokens in the micro-batch
    a = m.heads
    fam = m.fam
    grouped = m.kv_heads != m.heads

    # RMSNorm on the hidden size, per call. Llama/Qwen3 (HF): an fp32 copy of the input (the input itself in
    # fp32), the normalised tensor cast back to the model dtype, the output (saved by the next matmuls), 1/rms in
    # fp32. Liger's kernel saves only its input and 1/rms; its output is saved by the next matmuls.
    norm = (2 * e * T * h + 4 * T) if liger else (4 * T * h + 2 * e * T * h + 4 * T)
    if res != e:
        # fp32 stream under fp16 autocast: input, normalised tensor and output all fp32, plus the
        # autocast's 16-bit copy that the next matmuls save.
        norm = (2 * res * T * h + e * T * h + 4 * T) if liger else (4 * T * h + 2 * res * T * h + e * T * h + 4 * T)
    if fam.norm == "gemma":
        # Gemma3RMSNorm (modeling_gemma3.py:135-149) in fp32 whatever the dtype: x.float() (the input itself in
        # fp32), the normalised fp32 tensor, 1/rms and the (1 + w) vector; the output, cast back, is saved only
        # where a matmul reads it (input and pre-feedforward norms; the post-attention and post-feedforward
        # norms feed the residual add, which saves nothing). Liger (LigerRMSNormForGemma3): input + 1/rms.
        g_out = (2 * e * T * h + 4 * T) if liger else (8 * T * h + e * T * h + 4 * T + 4 * h)
        g_res = (e * T * h + 4 * T) if liger else (8 * T * h + 4 * T + 4 * h)
        norms = 2 * g_out + 2 * g_res
        final_norm = g_out
    else:
        norms = fam.norms_per_layer * norm
        final_norm = norm

    # q/k norms over head_dim, before RoPE (Qwen3, Gemma 3); their output goes to RoPE, which saves only cos/sin.
    qk = 0
    if fam.qk_norm:
        width, rows = m.q_dim + m.kv_dim, a + m.kv_heads  # elements and 1/rms values per token
        if liger:
            qk = e * T * width + 4 * T * rows
        elif fam.norm == "gemma":
            qk = 8 * T * width + 4 * T * rows + 2 * 4 * m.head_dim
        else:
            qk = (4 + e) * T * width + 4 * T * rows

    def attention_bytes(mask: bool) -> int:
        # RoPE saves only cos/sin (shared by all layers of a type): q, k do not need grad w.r.t. cos.
        if attention == "eager":
            kv = 2 * e * T * (m.q_dim if grouped else m.kv_dim)  # repeat_kv copies (or k, v themselves)
            scores = 4 * b * a * S * S + (e * b * a * S * S if e < 4 else 0)  # fp32 softmax + cast copy
            return e * T * m.q_dim + kv + scores + e * T * m.q_dim  # q, k/v, scores, o_proj input
        if mask:
            # transformers repeats k/v when a mask is given (integrations/sdpa_attention.py use_gqa_in_sdpa);
            # torch converts the bool mask to the query dtype and the kernel saves it: micro x S x S x e per
            # layer being differentiated.
            kv = 2 * e * T * m.q_dim + e * b * S * S
        elif attention == "sdpa_docs":
            # k/v repeated to every query head (attention.py), no mask; the documents' outputs (saved by SDPA)
            # are concatenated into a second copy that o_proj saves: SDPA's single output was shared with it
            kv = 2 * e * T * m.q_dim + e * T * m.q_dim
        else:
            kv = 2 * e * T * m.kv_dim  # native GQA: k, v at kv heads
        # q, k, v, output (shared with o_proj's input), logsumexp in fp32
        return e * T * m.q_dim + kv + e * T * m.q_dim + 4 * b * a * S

    # SwiGLU (silu) and Gemma's GeGLU (gelu tanh) save the same: gate, up, act(gate), product; Liger recomputes act.
    mlp = (3 if liger else 4) * e * T * I
    full_mask = attention_has_mask(attention, packing, micro, padded)
    kinds = {"full_attention": attention_bytes(full_mask)}
    if m.sliding_layers:
        if attention == "sdpa_docs":  # the window inside each document: banded block masks, no S x S one
            kinds["sliding_attention"] = (attention_bytes(full_mask) if full_mask else attention_bytes(False)
                                          + e * b * sliding_block_mask_elements(S, m.sliding_window or S))
        else:
            # masking_utils.py _ignore_causal_mask_sdpa: a sliding layer gets a dense mask once seq >= its window
            slide_mask = full_mask or (attention != "flash_attention_2" and seq >= (m.sliding_window or seq + 1))
            kinds["sliding_attention"] = attention_bytes(slide_mask)
    types = list(m.layer_types) if m.layer_types else ["full_attention"] * m.layers
    layer_of = {k: norms + qk + v + mlp for k, v in kinds.items()}
    layers = [layer_of[t] for t in types]

    ids = 8 * T + (e if fam.embed_scale else 0)  # Gemma: the embed_scale scalar its multiply saves
    rope_one = 2 * (b if packing else 1) * S * m.head_dim * e  # cos, sin: per sample when positions restart
    rope = rope_one * len(set(types))  # Gemma 3: a global and a local rotary embedding
    loss = 0 if (liger or fused_loss) else 4 * T * m.vocab + 8 * b * (S + 1) + 4  # log-softmax output (fp32), labels
    layer_inputs = m.layers * res * T * h

    if not checkpointing:
        fwd_end = ids + rope + sum(layers) + final_norm + loss
        peak = fwd_end
        recompute = 0
    else:
        fwd_end = ids + layer_inputs + final_norm + loss
        # Recomputing layer i in backward: the inputs of layers 0..i are still alive. In fp32 (or with Liger)
        # the first norm saves its input tensor itself, i.e. the checkpointed input: count it once.
        dedup = res * T * h if (res == 4 or liger) else 0
        recomputes = [layer + rope_one - dedup for layer in layers]
        recompute = max(recomputes)
        peak = max([fwd_end] + [ids + (i + 1) * res * T * h + r for i, r in enumerate(recomputes)])
    return {"layer": max(layers), "per_layer": {"norms": norms + qk, "attention": max(kinds.values()), "mlp": mlp},
            "layer_inputs": layer_inputs if checkpointing else 0, "recompute": recompute,
            "final_norm": final_norm, "loss_saved": loss, "small": ids + rope,
            "forward_end": fwd_end, "saved_peak": peak}


def persistent_mask_bytes(micro: int, seq: int, dtype_bytes: int, attention: str, packing: bool,
                          padded: bool | None = None) -> int:
    """The mask transformers builds once per forward and every layer reads (not a saved tensor)."""
    if not attention_has_mask(attention, packing, micro, padded):
        return 0
    return micro * seq * seq * (dtype_bytes if attention == "eager" else 1)  # eager: additive float; sdpa: bool


def logits_loss_bytes(m: ModelShape, tokens: int, dtype_bytes: int, liger: bool,
                      capability: tuple[int, int] | None = None, lm_head_trainable: bool = True) -> tuple[int, str]:
    """Peak of the output layer + cross entropy for one micro-batch."""
    if not liger:
        # HF: logits upcast to fp32, log-softmax output saved, then its gradient and the input
        # gradient in backward: ~12 B x vocab per token (NOTES), whatever the model dtype.
        return 12 * m.vocab * tokens, "fp32 logits, log-softmax and their gradients (12 B x vocab x tokens)"
    # Liger fused linear cross entropy: logits only for a chunk of tokens at a time, but the
    # gradients of the input and of lm_head.weight are computed in forward and kept until backward.
    inc = math.ceil(m.vocab / m.hidden)
    chunk = min(tokens, 1 << max(0, math.ceil(math.log2(math.ceil(tokens / inc)))))
    b = chunk * m.vocab * dtype_bytes + tokens * m.hidden * dtype_bytes + 4 * tokens
    how = f"Liger fused CE: {chunk}-token logits chunk + input grad"
    if lm_head_trainable:
        b += m.vocab * m.hidden * dtype_bytes
        how += " + lm_head weight grad"
    return b, how


def preference_loss_bytes(m: ModelShape, tokens: int, dtype_bytes: int, chunk: int,
                          lm_head_trainable: bool = True) -> tuple[int, str]:
    """Peak of DPO's fused loss for one micro-batch of `tokens` tokens (preference/loss.py FusedTokenLoss), bounded by
    taking every token as a label (completions as long as the rows). Forward: the label positions' hidden states
    (e B) and their fp32 gradient, lm_head's fp32 gradient (4 B x vocab x hidden), and one chunk's fp32 logits,
    softmax-gradient and its 16-bit copy ((8 + e) B x chunk x vocab). Backward scales the saved gradients: lm_head's
    is cast to the model dtype beside its fp32 buffer, the hidden states' likewise. The larger of the two instants."""
    e, V, h = dtype_bytes, m.vocab, m.hidden
    c = min(chunk, tokens)
    head = 4 * V * h if lm_head_trainable else 0
    forward = (e + 4) * tokens * h + head + (8 + e) * c * V + 4 * c * h
    backward = (4 + e) * tokens * h + head + (e * V * h if lm_head_trainable else 0)
    return max(forward, backward), (f"fused DPO loss: {c:,}-token logits chunk (fp32) + label positions' hidden states "
                                    f"and their fp32 grad" + (" + lm_head's fp32 grad" if lm_head_trainable else "")
                                    + "; no sequence x vocabulary logits")


def liger_fallback_bytes(m: ModelShape, dtype_bytes: int, liger: bool, capability: tuple[int, int] | None,
                         lm_head_trainable: bool) -> int:
    """Transient of Liger's fused CE below sm80, during forward. Its 16-bit addmm paths need capability 8
    (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py:326-354, `get_device_capability(...)[0] >= 8`);
    otherwise every chunk runs `grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()`
    (line 371): a vocab x hidden 16-bit product and its fp32 copy alive together (8B: 0.98 + 1.96 GiB)."""
    if not (liger and lm_head_trainable and dtype_bytes == 2 and capability is not None and capability < (8, 0)):
        return 0
    return m.vocab * m.hidden * (dtype_bytes + 4)


# The memory-efficient kernel's backward tile on sm70 (torch's cutlass kernels: kBlockSizeI 64 for f16 there)
SM70_OUTPUT_IN_RF_MAX_HEAD_DIM = 64


def sm70_attention_backward_bytes(m: ModelShape, tokens: int, dtype_bytes: int, attention: str,
                                  capability: tuple[int, int] | None) -> int:
    """What SDPA's memory-efficient backward allocates on a V100 beyond the layer's saved tensors, for `tokens` query
    tokens (all heads) in one call. torch's cutlass backward computes delta = rowsum(dO x O) in its kernel only for
    16-bit inputs whose output stays in registers, or off sm70 (aten/src/ATen/native/transformers/cuda/
    mem_eff_attention/kernel_backward.h: kKernelComputesDelta = kIsHalf && (kOutputInRF || arch != 70)); otherwise
    attention_backward.cu first computes it in fp32 with ATen: `(grad_out.to(kFloat) * out.to(kFloat)).sum(-1)`,
    an fp32 copy of dO, of O and their product alive together, 12 B per query-token element (fp32 inputs: only the
    product, 4 B). On sm70 the f16 output stays in registers up to head_dim 64 (SmolLM2) and, in the 64x64 kernel
    this assumes, not at 128 (Llama-3.1-8B). Unverified on a V100: torch also builds a 128x64 f16 sm70 kernel for
    head_dim 128 (mem_eff_attention/kernels/generate_kernels.py, cutlassB.h lists it first) whose output does stay in
    registers, and attention_backward.cu launches the first kernel whose shared memory fits (96 KB on a V100); if
    that one runs, delta is computed in the kernel and this term is 0 (an over-count: the plan errs safe). The
    GPU kit's attention rows on a V100 settle which. The kernel's own fp32 workspace (gQ's accumulation, ~4 B per element) comes after the delta's
    temporaries are freed and is smaller: the larger counts. A bound for sdpa_docs, which calls SDPA once per
    document: the row as one document."""
    if capability != (7, 0) or attention not in ("sdpa", "sdpa_docs"):
        return 0
    if dtype_bytes == 4:
        return 4 * tokens * m.q_dim
    return 12 * tokens * m.q_dim if m.head_dim > SM70_OUTPUT_IN_RF_MAX_HEAD_DIM else 0


# ---------------------------------------------------------------------------------------------
# Model states and DeepSpeed buffers
# ---------------------------------------------------------------------------------------------

# What an unset or "auto" zero_optimization size becomes, from the hidden size h: transformers fills the "auto"
# ones (integrations/deepspeed.py), DeepSpeed defaults the others.
ZERO_AUTO = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h, "stage3_max_live_parameters": lambda h: 10 ** 9,
             "sub_group_size": lambda h: 10 ** 9}


def zero_number(zero: dict | None, key: str, hidden: int = 0) -> int:
    """A number of elements from a resolved zero_optimization (ZERO_AUTO where unset or "auto"). A value DeepSpeed
    would refuse at launch is refused here, naming the key."""
    v = (zero or {}).get(key)
    if v in (None, "auto"):
        return ZERO_AUTO[key](hidden)
    try:
        if isinstance(v, bool):
            raise ValueError
        return int(float(v))
    except (TypeError, ValueError):
        raise UserError(f"zero_optimization.{key} is {v!r}: DeepSpeed takes a number of elements or \"auto\"; fix "
                        f"train.zero.{key} in the recipe (or the DeepSpeed JSON it names).") from None


def sub_group_size(zero: dict | None) -> int:
    """DeepSpeed's optimizer sub-group, in elements per rank (zero_optimization.sub_group_size; DeepSpeed's
    default 1e9): the unit the optimizer step upcasts gradients in and torch.save writes one tensor of."""
    return zero_number(zero, "sub_group_size")


def model_states_bytes(m: ModelShape, zero: dict | None, gpus_per_node: int, nodes: int) -> tuple[int, int, str]:
    """(per-GPU bytes, per-node CPU bytes, how it was computed) for the ZeRO stage and offload in use."""
    if zero is None:
        # No DeepSpeed: every rank holds 16-bit weights + grads and fp32 master + Adam moments.
        return 16 * m.n_params, 0, "no DeepSpeed: 16 B/param on every GPU (2 weights + 2 grads + 12 Adam/fp32 master)"
    stage = int(zero.get("stage", 0))
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    off_par = (zero.get("offload_param") or {}).get("device", "none") in ("cpu", "nvme")
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total_params=m.n_params, largest_layer_params=m.largest_layer_params,
            num_gpus_per_node=gpus_per_node, num_nodes=nodes, cpu_offload=off_opt,
            cpu_offload_params=off_par, zero_init=True)
        how = (f"DeepSpeed estimate_zero3_model_states_mem_needs({m.n_params:,}, {m.largest_layer_params:,}, "
               f"{gpus_per_node}, {nodes}, cpu_offload={off_opt}, cpu_offload_params={off_par}, zero_init=True)")
        return gpu, cpu, how
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(m.n_params, gpus_per_node, nodes, cpu_offload=off_opt)
        return gpu, cpu, f"DeepSpeed estimate_zero2_model_states_mem_needs (stage {stage}; stage 1 keeps full grads: optimistic)"
    return 16 * m.n_params, 0, "ZeRO stage 0: 16 B/param on every GPU"


_LORA_DIMS = {  # (in, out) of each decoder linear (the same names in every family: families.py lora_targets)
    "q_proj": lambda m: (m.hidden, m.q_dim), "k_proj": lambda m: (m.hidden, m.kv_dim),
    "v_proj": lambda m: (m.hidden, m.kv_dim), "o_proj": lambda m: (m.q_dim, m.hidden),
    "gate_proj": lambda m: (m.hidden, m.intermediate), "up_proj": lambda m: (m.hidden, m.intermediate),
    "down_proj": lambda m: (m.intermediate, m.hidden),
}
REFERENCE_COPY = "reference copy (GRPO's KL, whole)"
NF4_BYTES_PER_PARAM = 0.5 + 0.127 / 8  # 4-bit codes + double-quantized absmax (8-bit per 64, fp32 per 256 blocks)


def peft_trainable_params(m: ModelShape, r: int, targets: list, modules_to_save: list) -> int:
    """LoRA A and B (r x (in + out)) on every targeted linear of every layer, plus fully trained modules."""
    m.fam.check_lora_targets(targets)  # a name that is not a linear of this family: refused, not left uncounted
    names = list(_LORA_DIMS) if list(targets) == ["all-linear"] else list(targets)
    n = m.layers * sum(r * sum(_LORA_DIMS[t](m)) for t in names)
    return n + sum(m.vocab * m.hidden for t in modules_to_save if t in ("embed_tokens", "lm_head"))


def peft_model_states_bytes(m: ModelShape, method: str, trainable: int, zero: dict | None,
                            gpus_per_node: int, nodes: int) -> tuple[int, int, str]:
    """LoRA/QLoRA model states per GPU: frozen base 2 B/param (QLoRA: NF4 for the decoder linears), 16 B per
    trainable parameter (16-bit weight + grad + fp32 master + Adam moments). ZeRO-3 shards both for LoRA;
    QLoRA runs without DeepSpeed, so every GPU holds the whole 4-bit base."""
    world = gpus_per_node * nodes
    if method == "qlora":
        linear = m.layers * sum(a * b for a, b in (f(m) for f in _LORA_DIMS.values()))
        # prepare_model_for_kbit_training upcasts the non-quantized params (embeddings, norms, lm_head) to fp32
        base = int(NF4_BYTES_PER_PARAM * linear + 4 * (m.n_params - linear))
        return (base + 16 * trainable, 0,
                f"QLoRA: NF4 decoder linears {linear:,} x {NF4_BYTES_PER_PARAM:.3f} B + other frozen params x 4 B (fp32) "
                f"+ {trainable:,} trainable x 16 B; no ZeRO sharding")
    if zero is not None and int(zero.get("stage", 0)) == 3:
        b = math.ceil((2 * m.n_params + 16 * trainable) / world) + 4 * m.largest_layer_params
        return b, 0, (f"LoRA + ZeRO-3: (frozen {m.n_params:,} x 2 B + {trainable:,} trainable x 16 B) / {world} GPUs "
                      f"+ 4 B x largest layer (gathered)")
    return 2 * m.n_params + 16 * trainable, 0, f"LoRA: frozen base x 2 B + {trainable:,} trainable x 16 B on every GPU"


def deepspeed_buffers(m: ModelShape, zero: dict | None, world: int, dtype_bytes: int) -> dict:
    """What ZeRO-3 allocates beyond the estimator's model states (bytes per GPU)."""
    if zero is None or int(zero.get("stage", 0)) != 3:
        return {}
    h = m.hidden
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    per_rank = math.ceil(m.n_params / world)
    out = {}
    if not off_opt:
        # The optimizer step upcasts one sub-group of gradients to fp32 at a time.
        out["fp32 grad sub-group"] = 4 * min(sub_group_size(zero), per_rank)
    reduce = zero_number(zero, "reduce_bucket_size", h) * dtype_bytes
    out["reduce bucket"] = reduce * (2 if zero.get("overlap_comm", True) else 1)  # double-buffered with overlap
    out["prefetch bucket"] = zero_number(zero, "stage3_prefetch_bucket_size", h) * dtype_bytes
    # Gathered 16-bit parameters: up to stage3_max_live_parameters. The estimator already holds
    # 4 B x largest layer for gathering; count only what exceeds it.
    live = min(zero_number(zero, "stage3_max_live_parameters"), m.n_params) * dtype_bytes
    out["live gathered params"] = max(0, live - 4 * m.largest_layer_params)
    return out


def offload_handoff_bytes(m: ModelShape, zero: dict | None, world: int, accum_bytes: int) -> int:
    """GPU transient of ZeRO-3 optimizer offload when the largest layer's gradient is handed to the host.

    The gradient partitions themselves live in pinned host memory under offload (deepspeed 0.19.8
    stage3.py:333 sets self.device to CPU; :791-795 allocates and pins grad_partitions_flat_buffer), but
    each reduced partition passes through the GPU three times at once (stage3.py, partition_grads): the
    reduce-scatter output converted to the accumulation dtype (:1944), a GPU copy of the pinned partition
    (:2025-2028, "ensure grad buffer is a CUDA buffer") and, at the accumulation boundary, an fp64 copy for
    its norm (_constant_buffered_norm2, :1446 and :1960-1966; zero/utils.py get_norm_dtype). The largest
    layer is the embedding, reduced last in backward, when activations and logits are already freed."""
    if zero is None or int(zero.get("stage", 0)) != 3:
        return 0
    if (zero.get("offload_optimizer") or {}).get("device", "none") not in ("cpu", "nvme"):
        return 0
    return (2 * accum_bytes + 8) * math.ceil(m.largest_layer_params / world)


# What the collators hand the Trainer per micro-batch: three int64 tensors of micro x seq (zerotune train/args.py
# collate_packed: input_ids, labels, position_ids; make_collate_padded: input_ids, labels, attention_mask).
BATCH_TENSORS = 3


def prefetched_batches_bytes(micro: int, seq: int, grad_accum: int, tensors: int = BATCH_TENSORS) -> int:
    """The micro-batches of one optimizer step resident on the GPU together.

    transformers 5.23 trainer.py:1873 fetches all `grad_accum` micro-batches of an optimizer step before the
    first forward (get_batch_samples, :2281-2296, appends next(epoch_iterator) GA times), and accelerate 1.15
    data_loader.py:595-600 (DataLoaderShard.__iter__) moves each batch to the device before yielding it
    (Trainer's Accelerator keeps device_placement=True, accelerator.py:2719-2730). So GA x micro x seq x
    tensors x 8 B stay on the GPU for the whole step, and through the step's save and in-training evaluation
    (the list is alive until the next step's fetch). Bounded by seq: padded batches are at most seq long."""
    return grad_accum * tensors * micro * seq * 8


def ulysses_kv_dim(m: ModelShape, sequence_parallel: int) -> int:
    """K (or V) width per token that DeepSpeed's Ulysses exchanges: the model's KV heads, copied up to N heads when
    N is more than them (ulysses_sp.py combine_sequence, repeat_interleave by kv_replication_factor)."""
    return max(m.kv_heads, sequence_parallel) * m.head_dim


def ulysses_bytes(m: ModelShape, tokens: int, e: int, sequence_parallel: int) -> int:
    """GPU bytes DeepSpeed's Ulysses holds beyond the layer's own tensors, at its worst instant, for `tokens` tokens
    on this rank (deepspeed 0.19.8 ulysses_sp.py): each of q, k, v is laid out for the exchange (rearrange ...
    .contiguous(), a copy) and received into a new tensor (_dim_zero_all_to_all), then laid out again for the
    attention (a copy, which the attention saves: counted with the layer); two copies of each are alive together.
    The output goes back the same way (_partition_global_sequence), two copies of its width, after q, k, v are
    freed: the larger of the two is the term."""
    kv = ulysses_kv_dim(m, sequence_parallel)
    return 2 * e * tokens * max(m.q_dim + 2 * kv, m.q_dim)


def memory_breakdown(m: ModelShape, *, seq: int, micro: int, precision: str, attention: str, liger: bool,
                     checkpointing: bool, packing: bool, zero: dict | None, gpus_per_node: int, nodes: int,
                     gpu_is_cuda: bool = True, peft: tuple[str, int] | None = None,
                     capability: tuple[int, int] | None = None, lm_head_trainable: bool | None = None,
                     grad_accum_bytes: int | None = None, grad_accum: int = 1,
                     preference_chunk: int | None = None, sequence_parallel: int = 1,
                     reference_copy: int = 0) -> dict:
    """Ordered {component: bytes} per GPU plus the peak (their sum) and notes. capability: the target GPU's
    (Liger's fused CE takes a costlier path below sm80); lm_head_trainable: default full fine-tuning only;
    grad_accum_bytes: DeepSpeed's gradient accumulation dtype (data_types.grad_accum_dtype; default: the
    model's); grad_accum: micro-batches per optimizer step (all of them sit on the GPU together:
    prefetched_batches_bytes); preference_chunk: DPO (preference.chunk_tokens): micro counts rows (2 per pair), and
    the loss is the fused DPO loss (preference_loss_bytes) instead of cross entropy. reference_copy: GRPO with a KL
    term (rl.beta > 0): the starting model's frozen copy, whole on every GPU (rl/objective.py replicated_model).

    sequence_parallel: N ranks share each row (train/sequence_parallel.py). Every per-token term is this rank's
    seq / N tokens: the layer inputs, the recompute, the logits and the batches. Attention runs on all seq tokens
    for heads / N, the same number of elements (its logsumexp too), so its terms are counted at seq / N as well;
    what is not divided is the model states and DeepSpeed's buffers (ZeRO-3 partitions those over every rank with
    or without SP) and the calibration overheads. Added: the all-to-all copies of one layer (ulysses_bytes). The
    adapter keeps the step's sliced micro-batches on the host (ulysses_sp.py refill: .cpu()); the Trainer moves one
    at a time to the GPU. Not divided but not counted: Gemma 3's banded sliding-window masks cover the whole row
    (a few MiB per layer at 32K)."""
    e = 2 if precision in ("fp16", "bf16") else 4
    if sequence_parallel > 1:
        seq, grad_accum = seq // sequence_parallel, 1
    world = gpus_per_node * nodes
    if peft is not None:  # (method, trainable params)
        states, cpu_bytes, how = peft_model_states_bytes(m, peft[0], peft[1], zero, gpus_per_node, nodes)
    else:
        states, cpu_bytes, how = model_states_bytes(m, zero, gpus_per_node, nodes)
    # QLoRA: prepare_model_for_kbit_training casts every non-4-bit 16-bit parameter to fp32 (peft 0.21.2
    # peft/utils/other.py:204-209), embeddings included, so the residual stream runs in fp32 under autocast.
    res = 4 if peft is not None and peft[0] == "qlora" else e
    padded = pair_rows_padded(m, attention) if preference_chunk is not None else None
    act = activation_bytes(m, micro, seq, e, attention, checkpointing, packing, liger, padded=padded, residual_bytes=res,
                           fused_loss=preference_chunk is not None)
    parts = {"model states (DeepSpeed estimator)": states}
    if reference_copy:
        parts[REFERENCE_COPY] = reference_copy
    buffers = deepspeed_buffers(m, zero, world, e)
    parts.update(buffers)
    if checkpointing:
        parts["checkpointed layer inputs"] = act["layer_inputs"] + act["final_norm"] + act["small"]
        # One layer's recompute: its saved tensors plus the gradients flowing through it
        # (about one intermediate-size and two hidden-size tensors; not visible to saved-tensor hooks).
        parts["one-layer recompute"] = act["recompute"] + micro * seq * (e * m.intermediate + res * 2 * m.hidden)
    else:
        parts["activations (all layers)"] = act["forward_end"] - act["loss_saved"]
    parts["attention mask"] = persistent_mask_bytes(micro, seq, e, attention, packing, padded)
    if sequence_parallel > 1:
        parts["Ulysses all-to-all copies (one layer)"] = ulysses_bytes(m, micro * seq, e, sequence_parallel)
    # The in-flight micro-batch's input_ids are already counted with the activations (act["small"]: the
    # embedding saves them); every other tensor of the step's micro-batches is counted here.
    batches = prefetched_batches_bytes(micro, seq, grad_accum)
    parts["GA micro-batches (prefetched)"] = batches - 8 * micro * seq
    head_trainable = peft is None if lm_head_trainable is None else lm_head_trainable
    if preference_chunk is not None:
        logits, logits_how = preference_loss_bytes(m, micro * seq, e, preference_chunk, head_trainable)
    else:
        logits, logits_how = logits_loss_bytes(m, micro * seq, e, liger, capability, head_trainable)
    fallback = liger_fallback_bytes(m, e, liger and preference_chunk is None, capability, head_trainable)
    if fallback:
        # It lives at the end of forward, the backward recompute only in backward: the sum above already
        # holds the recompute's bytes, so only the excess is added.
        recompute = parts.get("one-layer recompute", 0)
        logits += max(0, fallback - recompute)
        logits_how += (f" + sm<80 fallback transient {fallback / GiB:.2f} GiB (forward only; counted beyond the "
                       f"{recompute / GiB:.2f} GiB backward recompute it cannot coexist with)")
    parts["logits + loss"] = logits
    sm70 = sm70_attention_backward_bytes(m, micro * seq, e, attention, capability)
    if sm70:
        # inside one layer's backward, after its MLP's backward has freed what the MLP saved (backward runs the
        # layer in reverse): only what exceeds those raises the peak beyond the one-layer recompute
        parts["sm70 attention backward (beyond MLP)"] = max(0, sm70 - act["per_layer"]["mlp"])
    # Freed before the two transients below: activations, the mask and the logits (not the micro-batches).
    transient = (sum(parts.values()) - states - reference_copy - sum(buffers.values())
                 - parts["GA micro-batches (prefetched)"])
    # The offload hand-off happens at the end of backward, after every activation and the logits are freed:
    # only what exceeds them raises the peak.
    handoff = offload_handoff_bytes(m, zero, world, grad_accum_bytes or e)
    # At the step boundary the next step's micro-batches are fetched while the last step's list is still bound
    # (trainer.py:1873 assigns batch_samples only when get_batch_samples returns): twice the batches, with no
    # activations alive. Only what exceeds the freed activations raises the peak (never at realistic GA).
    # The two happen at different times: the larger excess counts.
    if max(handoff, batches) > transient:
        name = ("offload grad hand-off (end of backward)" if handoff >= batches
                else "next step's micro-batches (step boundary)")
        parts[name] = max(handoff, batches) - transient
    # Fragmentation, CUDA context, NCCL and the allocated/reserved/nvidia-smi views: calibration.py
    allocated = sum(parts.values())
    parts.update(extra := calibration.overheads(allocated, world=world, gpu_is_cuda=gpu_is_cuda))
    return {"parts": parts, "peak": sum(parts.values()), "views": calibration.views(allocated, extra, gpu_is_cuda),
            "cpu_bytes_per_node": cpu_bytes, "sm70_delta_bytes": sm70, "mlp_saved_bytes": act["per_layer"]["mlp"],
            "model_states_how": how, "logits_how": logits_how, "activation_detail": act,
            "dtype_bytes": e}
