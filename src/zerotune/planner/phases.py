"""The peak of every phase of a training job, not only the training step: what each phase holds at its worst
instant, per GPU (or on the host where host RAM is what runs out), against what the device offers.

    train_step    forward + backward of one micro-batch (memory.memory_breakdown)
    validation    the in-training eval loss: one no-grad forward per eval row of seq_len (train/validation.py nll_sum)
    samples       greedy generate() with a KV cache on eval.samples prompts (train/validation.py _samples)
    reference     DPO only: the starting model's log-probs of every pair before the first step, one no-grad forward
                  of a micro-batch's rows at a time (preference/reference.py); validation is the same forward
    save          a checkpoint: ZeRO-3 16-bit consolidation + each rank's optimizer shard (GPU; save_host: RAM)
    resume        DeepSpeed load_checkpoint of the ZeRO-3 optimizer shards (GPU; resume_host: RAM)
    finalize      rank 0's CPU process that verifies and publishes the model (host RAM, planner/finalize_ram.py)
    quantize      llama.cpp's convert_hf_to_gguf.py on the published 16-bit model (host RAM)

Before the job, in the data step: replay (planner/replay.py), the base model answering data.replay's prompts in
left-padded batches on one device (data/replay.py), its peak and its time.

Outside the training step every phase shares what stays resident between steps: the model states (the same
DeepSpeed estimate as the step), DeepSpeed's reduce buckets (allocated once, deepspeed 0.19.8
runtime/zero/stage3.py:781-782) and the step's micro-batches, which stay bound until the next step fetches
its own (memory.prefetched_batches_bytes). The fp32 gradient sub-group is not: the optimizer step frees it
(stage3.py:2731-2735, _release_sub_group). Each phase's tensors are modelled term by term from the pinned
sources (transformers 5.23.0, deepspeed 0.19.8, liger-kernel 0.8.5, accelerate 1.15.0, torch 2.13); the same
calibration overheads as the training step (fragmentation, CUDA context, NCCL) are added to every GPU phase.
"""

from __future__ import annotations

import math

from ..quant_types import QUANT_TYPES
from . import calibration
from .finalize_ram import INTERPRETER_BYTES, finalize_host_bytes
from .memory import (
    REFERENCE_COPY,
    GiB,
    ModelShape,
    attention_has_mask,
    deepspeed_buffers,
    persistent_mask_bytes,
    prefetched_batches_bytes,
    sub_group_size,
)
from .records import Phase, Phases, Views

MODEL_STATES = "model states (DeepSpeed estimator)"


def host_phase(parts: dict, capacity: int, what: str, fix: str) -> Phase:
    return Phase(peak_bytes=sum(parts.values()), capacity_bytes=capacity, limit="host", what=what, fix=fix, runs=True,
                 parts=parts)


def gpu_phase(tensors: dict, capacity: int, world: int, on_gpu: bool, what: str, fix: str, runs: bool = True,
              views: dict | None = None, generating: dict | None = None) -> Phase:
    """A GPU phase: its tensors plus the overheads every GPU phase carries (calibration.overheads), and the
    allocated / reserved / nvidia-smi views of its peak as for the training step (calibration.views). views: the
    training step's, whose tensors carry their overheads already."""
    parts, extra = dict(tensors), {}
    if views is None:
        extra = calibration.overheads(sum(tensors.values()), world=world, gpu_is_cuda=on_gpu)
        parts.update(extra)
        views = calibration.views(sum(tensors.values()), extra, on_gpu)
    # generate()'s terms with the phase's overheads (fragmentation, the CUDA context): the run's rule compares them
    # with the free memory it measures, so the margin the plan keeps is the run's too
    return Phase(peak_bytes=sum(parts.values()), capacity_bytes=capacity, limit="gpu" if on_gpu else "host",
                 what=what, fix=fix, runs=runs, parts=parts, views=Views(**views),
                 generating_bytes=sum(generating.values()) + sum(extra.values()) if generating else 0)


# ---------------------------------------------------------------------------------------------
# No-grad forward (validation, generation prefill)
# ---------------------------------------------------------------------------------------------

def nograd_layer_bytes(m: ModelShape, tokens: int, e: int, *, mask: tuple[int, int, int] | None = None,
                       liger: bool, cached: bool = False, on_gpu: bool = False, repeat_kv: bool = False) -> dict:
    """Peak bytes inside one decoder layer under torch.no_grad(), beyond the residual stream entering it.
    Nothing is saved for backward; what is alive is the layer's own temporaries (transformers 5.23
    models/llama/modeling_llama.py, LlamaDecoderLayer.forward: `residual` + the block's input and output).

    mask: (rows, q_len, kv_len) when a dense (rows, 1, q_len, kv_len) mask reaches SDPA, else None (is_causal, no
      mask). Packed validation rows: (1, S, S); left-padded generation: (B, S, S) in prefill, (B, 1, L) per
      decode step. With a mask, use_gqa_in_sdpa (integrations/sdpa_attention.py:52) refuses native GQA: a q_len > 1
      gets k and v repeated to all query heads (:137-138; a copy only when 1 < kv heads < heads: repeat_kv returns
      k itself or a view otherwise, :26-30), a single query token is regrouped instead (:132-134, pack_gqa, a
      view). torch converts the bool mask to the query dtype (aten/src/ATen/native/transformers/attention.cpp,
      convert_boolean_attn_mask: at::where, a new tensor; the CPU kernel too, measured in
      tests/test_phase_memory.py); on CUDA the memory-efficient kernel (the V100's and T4's) pads it to aligned
      columns first (preprocess_mask -> pad_bias: a second copy beside the first), counted unless kv_len is a
      multiple of 16. Read in upstream attention.cpp (torch's C++ is not in the wheel; not checked on a GPU here):
      torch 2.5+ pads to 8 before broadcasting to the heads; torch 2.1 padded to 16 after, heads x larger.
    repeat_kv: sdpa_docs (attention.py) without a mask: k and v repeated to all query heads for every q_len > 1 (a
      copy when 1 < kv heads < heads), the documents' outputs concatenated (no more alive at once than SDPA's
      output and its contiguous copy).
    cached: generate() fills a DynamicCache: DynamicLayer.update copies k and v into it (cache_utils.py:136-137) and
      the attention rebinds key_states/value_states to the cache's tensors (modeling_llama.py:251), so past RoPE the
      layer holds only q; the cache is the caller's term.
    Blocks (the largest counts, they run one after another):
      norm       HF LlamaRMSNorm upcasts: the fp32 input and its pow(2) (8 B x T x h); Liger's kernel writes
                 only its output and 1/rms.
      attention  normed input, q, k, v; then RoPE (HF `(q * cos) + (rotate_half(q) * sin)`: three q-sized
                 temporaries at its peak; Liger: contiguous copies of q and k) or SDPA (repeated k, v + mask
                 cast + output and its .contiguous() copy, sdpa_attention.py:206).
      mlp        post-attention norm output + gate, up and their product (HF: act(gate), up, product alive
                 together; Liger's SwiGLU kernel: gate, up, output): 3 x e x T x intermediate.
    """
    T, h = tokens, m.hidden
    norm = e * T * h + 4 * T if liger else 8 * T * h
    qkv = e * T * (m.q_dim + 2 * m.kv_dim)
    # HF: three q-sized temporaries, then q_embed beside three k-sized ones (more when kv heads = heads)
    rope = e * T * (m.q_dim + m.kv_dim) if liger else e * T * max(3 * m.q_dim, m.q_dim + 3 * m.kv_dim)
    sdpa = 2 * e * T * m.q_dim  # output + contiguous copy
    if repeat_kv and not mask and 1 < m.kv_heads < m.heads:
        sdpa += 2 * e * T * m.q_dim
    if mask:
        rows, q_len, kv_len = mask
        if q_len > 1 and 1 < m.kv_heads < m.heads:
            sdpa += 2 * e * rows * kv_len * m.q_dim  # repeat_kv'd k, v
        sdpa += e * rows * q_len * kv_len  # the mask in the query dtype
        if on_gpu and kv_len % 16:
            sdpa += e * rows * q_len * (kv_len + 16 - kv_len % 16)  # its padded copy (memory-efficient kernel)
    # cached: k and v have moved into the cache by the time SDPA runs
    attention = e * T * h + (max(qkv + rope, e * T * m.q_dim + sdpa) if cached else qkv + max(rope, sdpa))
    # after attention, `residual` (the sum) sits beside the layer's input the loop still holds (modeling_llama.py
    # :309 vs :391-392): one more e x T x h under the post-attention norm and the MLP (tests/test_phase_memory.py)
    post = e * T * h
    norm += post
    mlp = e * T * h + 3 * e * T * m.intermediate + post
    blocks = {"norm": norm, "attention": attention, "mlp": mlp}
    return {"blocks": blocks, "peak": max(blocks.values()), "residual": e * T * h}


def eval_loss_bytes(m: ModelShape, tokens: int, e: int, fused: bool) -> tuple[int, str]:
    """Bytes of the output layer + loss for one eval forward of `tokens` tokens (no grad).

    fused (Liger on; validation.nll_sum passes skip_logits=True): liger_kernel 0.8.5
      transformers/model/llama.py:118-127 calls LigerForCausalLMLoss, whose ops/fused_linear_cross_entropy.py
      allocates grad_input = zeros_like(input) even without grad (:108), loss_1d in fp32 (:125) and one logits
      chunk of next_pow2(ceil(T / ceil(V / h))) rows x V (:103-104, :150-152); labels padded and shifted
      (transformers/model/loss_utils.py:87-88: two int64 copies).
    not fused (Liger off, or Liger without skip_logits): transformers keeps the model-dtype logits
      (models/llama/modeling_llama.py:468) while ForCausalLMLoss upcasts them (loss/loss_utils.py:61) and
      cross_entropy materialises the fp32 log-softmax: (e + 4 + 4) B x vocab x tokens (fp32 logits: no upcast
      copy, 8 B).
    """
    T, V = tokens, m.vocab
    labels = 8 * (T + 1) + 8 * T
    if fused:
        inc = math.ceil(V / m.hidden)
        chunk = min(T, 1 << max(0, math.ceil(math.log2(math.ceil(T / inc)))))
        return (chunk * V * e + e * T * m.hidden + 4 * T + T + labels,
                f"Liger fused CE: {chunk}-token logits chunk + zeroed input-grad buffer")
    up = 4 if e < 4 else 0  # fp32 logits: .float() returns the tensor itself, no copy (measured, test_phase_memory)
    return (e + up + 4) * T * V + labels, f"full logits ({8 * e}-bit){' + fp32 upcast' * bool(up)} + fp32 log-softmax"


def nograd_forward_parts(m: ModelShape, tokens: int, e: int, *, mask: tuple[int, int, int] | None, liger: bool,
                         loss: tuple[int, str] | None, cached: bool = False, on_gpu: bool = False,
                         repeat_kv: bool = False) -> dict:
    """The transient terms of one no-grad forward: the largest layer block over the residual stream, or the
    output layer (final norm output + loss / last-token logits) - whichever is larger (they are sequential).
    mask, cached, on_gpu, repeat_kv: as nograd_layer_bytes."""
    layer = nograd_layer_bytes(m, tokens, e, mask=mask, liger=liger, cached=cached, on_gpu=on_gpu,
                               repeat_kv=repeat_kv)
    head = e * tokens * m.hidden + (loss[0] if loss else 0)
    # cos, sin for the rows (shared by all layers): one per token when generate() gives per-row position_ids
    rope = 2 * tokens * m.head_dim * e
    out = {"rotary cos/sin": rope}
    # LlamaModel.forward keeps inputs_embeds referenced through the whole layer loop (modeling_llama.py:370, :388)
    # beside each layer's input: two copies of the residual stream from the second layer on
    residual = (2 if m.layers > 1 else 1) * layer["residual"]
    if residual + layer["peak"] >= head:
        out["residual stream"] = residual
        out[f"one layer, no grad ({max(layer['blocks'], key=layer['blocks'].get)} block)"] = layer["peak"]
    else:
        out[f"output layer: {loss[1] if loss else 'last-token logits'}"] = head
    return out


def generation_parts(m: ModelShape, *, rows: int, prompt: int, new_tokens: int, e: int, liger: bool, padded: bool,
                     on_gpu: bool, repeat_kv: bool = False) -> tuple[dict, dict]:
    """(prefill, decode): the transient terms of one greedy model.generate() call with a DynamicCache on `rows`
    prompts of `prompt` tokens (left-padded to that width when `padded`), `new_tokens` new tokens each, at the two
    instants that can peak. Sources: transformers 5.23 generation/utils.py, masking_utils.py, cache_utils.py,
    models/llama/modeling_llama.py; checked against torch.profiler allocations on CPU (tests/test_phase_memory.py).

    Token tensors (int64): the caller's input_ids and attention_mask; generate's position_ids (:906-908, cumsum of
      the mask), which generate()'s own model_kwargs keep for the whole call (:3007-3015 passes a copy of the dict
      to _sample); the forward's input_ids clone (:694). While decoding: the running input_ids (:3285), the mask the
      step's forward got (held by model_inputs) and the next step's position_ids and mask (:1275, :1281), each
      rows x (prompt + new); without padding no mask (dropped, below).
    Mask: an attention_mask with zeros (left padding) is not skipped (masking_utils.py:307, _ignore_causal_mask_sdpa
      needs it all ones) and sdpa_mask builds a (rows, 1, q_len, kv_len) bool mask (:552) that LlamaModel.forward
      holds through every layer (modeling_llama.py:380); SDPA's own copies are in nograd_layer_bytes. An all-ones
      mask is dropped by generate() (generation/utils.py:2897-2905): no mask, SDPA is_causal / native GQA.
    Prefill: the prompt's KV cache, the forward over rows x prompt tokens, then the last position's logits only
      (logits_to_keep=1, :2953-2954; modeling_llama.py:467) and their fp32 copy (:3247, copy=True even in fp32).
    Decode: the cache at its longest (the last token is never fed back: prompt + new - 1). The step's forward runs
      while the previous step's fp32 logits are still bound (next_token_logits, reassigned only after the new copy,
      :3247): inside it DynamicLayer.update concatenates one layer's K, then V (cache_utils.py:136-137: one old
      tensor beside its longer copy); after it the step's logits, the previous fp32 copy and the new one."""
    T, kv = rows * prompt, 2 * m.layers * m.kv_dim * e  # kv: K and V per token, all layers
    logits = rows * m.vocab * e
    prefill = {"KV cache (prompt)": kv * T,
               "token tensors (prompt ids + mask, position ids, ids copy)": 4 * 8 * T}
    if padded:
        prefill["attention mask (bool, rows x prompt x prompt)"] = rows * prompt * prompt
    prefill.update(nograd_forward_parts(m, T, e, mask=(rows, prompt, prompt) if padded else None, liger=liger,
                                        cached=True, on_gpu=on_gpu, repeat_kv=repeat_kv and prompt > 1,
                                        loss=(logits + 4 * rows * m.vocab,
                                                                          "last-token logits + fp32 copy")))
    cache = prompt + new_tokens - 1
    decode = {"KV cache (prompt + answer)": kv * rows * cache,
              # running ids and positions, and with padding the masks (an all-ones one is dropped)
              "token tensors (prompt's, running ids, masks, positions)":
                  3 * 8 * T + (4 if padded else 2) * 8 * rows * (prompt + new_tokens),
              "previous step's fp32 logits": 4 * rows * m.vocab}
    step = {"cache concat (one layer)": m.kv_dim * e * rows * cache}
    if padded:
        step["attention mask (bool, rows x cache)"] = rows * cache
    step.update(nograd_forward_parts(m, rows, e, mask=(rows, 1, cache) if padded else None, liger=liger, loss=None,
                                     cached=True, on_gpu=on_gpu))
    after = logits + 4 * rows * m.vocab
    if sum(step.values()) >= after:
        decode.update({f"decode step: {k}": v for k, v in step.items()})
    else:
        decode["last-token logits + fp32 copy"] = after
    return prefill, decode


# ---------------------------------------------------------------------------------------------
# The phases
# ---------------------------------------------------------------------------------------------

def phase_plan(*, m: ModelShape, train: dict, precision: str, attention: str, liger: bool, packing: bool,
               zero: dict | None, world: int, gpus_per_node: int, on_gpu: bool, seq: int, micro: int,
               grad_accum: int, trainable: int, peft: tuple[str, int] | None, gpu_capacity: int,
               host_capacity: int, validation_runs: bool, samples: int, max_new_tokens: int,
               quant_type: str, preference_chunk: int | None = None,
               rollout: tuple[int, int, int] | None = None, rollout_chunk: int | None = None,
               kl_reference: str | None = None) -> Phases:
    """Every phase's peak for one training job.
    `train` is memory.memory_breakdown's result for the recipe's own seq_len and micro-batch. preference_chunk: a DPO
    job (micro counts rows, 2 per pair): validation and the reference pass forward a micro-batch's padded rows with
    the fused log-probs (preference/loss.py sequence_logps: one chunk's fp32 logits, no sequence x vocabulary ones)."""
    e = train["dtype_bytes"]
    states = train["parts"][MODEL_STATES]
    offload = zero is not None and (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    ds = deepspeed_buffers(m, zero, world, e)
    batches = prefetched_batches_bytes(micro, seq, grad_accum)
    resident = {MODEL_STATES: states}
    ref_copy = train["parts"].get(REFERENCE_COPY, 0)  # GRPO's KL: loaded with the model, resident until the end
    if ref_copy:
        resident[REFERENCE_COPY] = ref_copy
    if "reduce bucket" in ds:
        resident["reduce bucket"] = ds["reduce bucket"]
    resident["GA micro-batches (still bound)"] = batches
    # A ZeRO-3 forward gathers layers ahead: prefetch bucket + live parameters (as in the training step)
    gathering = {k: ds[k] for k in ("prefetch bucket", "live gathered params") if k in ds}
    out = {}

    out["train_step"] = gpu_phase(train["parts"], gpu_capacity, world, on_gpu,
                                  f"forward + backward of {micro} x {seq:,} tokens (the breakdown above)",
                                  "see the training-step breakdown and suggestions", views=train["views"])

    docs = attention == "sdpa_docs"  # attention.py: per-document SDPA with k/v repeated to all heads
    if preference_chunk is None:
        # validation: validation.nll_sum, one row of <= seq tokens per forward, model.eval(), no grad, use_cache
        # False: packed position_ids give the block-causal mask (masking_utils.py:875-881) as in training.
        mask = attention_has_mask(attention, packing, 1)
        val = {**resident, **gathering, "eval row (input_ids, labels, position_ids)": 3 * 8 * seq,
               "attention mask": persistent_mask_bytes(1, seq, e, attention, packing),
               **nograd_forward_parts(m, seq, e, mask=(1, seq, seq) if mask else None, liger=liger, on_gpu=on_gpu,
                                      loss=eval_loss_bytes(m, seq, e, fused=liger), repeat_kv=docs)}
        out["validation"] = gpu_phase(
            val, gpu_capacity, world, on_gpu, f"eval loss, one {seq:,}-token row per forward, no grad",
            ("lower data.seq_len or use more GPUs (plan.gpus_per_node, plan.nodes)" if liger else
             "set train.liger=on (fused loss, no logits) or lower data.seq_len"), runs=validation_runs)
    else:
        # DPO: a micro-batch of pairs (micro rows, right-padded without a mask: preference/objective.py collate) per
        # no-grad forward, the completions' log-probs chunked (preference/reference.py pair_logps). The reference pass
        # runs before the first step (no micro-batches fetched yet); validation between steps (they are still bound).
        T = micro * seq
        c = min(preference_chunk, T)
        fused = (e * T * m.hidden + 8 * c * m.vocab + 4 * T, f"fused DPO log-probs: {c:,}-token fp32 logits chunk")
        pair_fwd = {"pair rows (input_ids, labels, position_ids)": 3 * 8 * T,
                    **nograd_forward_parts(m, T, e, mask=None, liger=liger, on_gpu=on_gpu, loss=fused,
                                           repeat_kv=docs)}
        before = {k: v for k, v in resident.items() if k != "GA micro-batches (still bound)"}
        out["reference"] = gpu_phase(
            {**before, **gathering, **pair_fwd}, gpu_capacity, world, on_gpu,
            f"the starting model's log-probs of every pair, {micro} x {seq:,}-token rows ({micro // 2} pair"
            f"{'s' if micro > 2 else ''}) per forward, no grad, once before step 1",
            "lower train.micro_batch_size or data.seq_len")
        out["validation"] = gpu_phase(
            {**resident, **gathering, **pair_fwd}, gpu_capacity, world, on_gpu,
            f"reward accuracy on the validation pairs, {micro} x {seq:,}-token rows per forward, no grad",
            "lower train.micro_batch_size or data.seq_len", runs=validation_runs)

    if rollout is not None:
        # GRPO (rl/rollout.py sample): before each micro-step's forward, one generate() of its rows (micro prompts x
        # G), left-padded, sampling, with a DynamicCache; the step's micro-batches are still bound (prompts only)
        n, prompt, new = rollout
        prefill, decode = generation_parts(m, rows=n, prompt=prompt, new_tokens=new, e=e, liger=liger, padded=True,
                                           on_gpu=on_gpu, repeat_kv=docs)
        gen = prefill if sum(prefill.values()) >= sum(decode.values()) else decode
        out["rollout"] = gpu_phase(
            {**resident, **gathering, **gen}, gpu_capacity, world, on_gpu,
            f"GRPO rollouts: {n} completions per micro-step, prompt <= {prompt:,} + {new} sampled tokens, KV cache",
            "lower train.micro_batch_size, rl.group_size or rl.max_new_tokens", generating=gen)
        if kl_reference:
            # the KL's reference pass (rl/objective.py reference_logps): the copy, or LoRA's policy with its adapters
            # off (gathered as any ZeRO-3 forward), forwards the micro-batch's rows (prompt + completion,
            # right-padded, no mask), no grad, per-token log-probs chunked (no vocab logits)
            T = n * seq
            c = min(rollout_chunk or T, T)
            fused = (e * T * m.hidden + 8 * c * m.vocab + 4 * T, f"fused per-token log-probs: {c:,}-token fp32 logits chunk")
            who = "copy" if kl_reference == "copy" else "base (the policy with its adapters off)"
            out["reference"] = gpu_phase(
                {**resident, **({} if kl_reference == "copy" else gathering),
                 "rollout rows (input_ids, labels, position_ids)": 3 * 8 * T,
                 **nograd_forward_parts(m, T, e, mask=None, liger=liger, on_gpu=on_gpu, loss=fused, repeat_kv=docs)},
                gpu_capacity, world, on_gpu,
                f"GRPO's KL: the starting model's {who} forwards each micro-step's {n} x {seq:,}-token rows, no grad",
                "set rl.beta: 0, lower train.micro_batch_size or rl.group_size, or add GPUs")

    # samples: generate() greedy with a DynamicCache, one prompt at a time (generation_parts). The prompt's length is
    # unknown before the tokenizer runs: bounded by data.seq_len (held-out prompts are shorter than the training
    # rows). Its attention mask is all ones: no mask reaches SDPA (generation_parts).
    prompt = seq
    prefill, decode = generation_parts(m, rows=1, prompt=prompt, new_tokens=max_new_tokens, e=e, liger=liger,
                                       padded=False, on_gpu=on_gpu, repeat_kv=docs)
    gen = prefill if sum(prefill.values()) >= sum(decode.values()) else decode
    out["samples"] = gpu_phase(
        {**resident, **gathering, **gen}, gpu_capacity, world, on_gpu,
        f"greedy generate, prompt <= {prompt:,} + {max_new_tokens} new tokens, KV cache",
        "set eval.samples=0 or lower data.seq_len", runs=samples > 0, generating=gen)

    # save (Trainer._save_checkpoint, trainer.py:3355-3392): save_model (:3369), then the optimizer shards (:3392).
    #   GPU: deepspeed runtime/engine.py:5654-5687 gathers one module's parameters at a time
    #   (GatheredParameters, inside the estimator's 4 B x largest layer) and copies them to rank 0's host
    #   (:5675 param.detach().cpu()); torch.save then writes each rank's shard (engine.py:5549-5564 ->
    #   checkpoint_engine torch.save), copying one storage at a time to the host (torch serialization.py
    #   :1279-1312). No activations: the step is over.
    out["save"] = gpu_phase(resident, gpu_capacity, world, on_gpu,
                            "checkpoint: gather 16-bit weights module by module, write shards",
                            "add GPUs or offload the optimizer (train.zero.offload_optimizer)")
    ranks = gpus_per_node
    per_rank = math.ceil(trainable / world) if zero is not None else trainable  # ZeRO partitions optimizer states
    cpu_states = train.get("cpu_bytes_per_node", 0) if offload else 0
    host = {"rank processes (1 GiB each: a floor, measured without CUDA)": ranks * INTERPRETER_BYTES}
    if cpu_states:
        host["offloaded optimizer states (DeepSpeed estimator, pinned)"] = cpu_states
    consolidated = (e * trainable if peft else e * m.n_params)  # peft: only the adapter (trainer.py:4110)
    # torch.save stages one storage at a time: a ZeRO sub-group's flat fp32 tensor (or one Adam moment of it);
    # without ZeRO the largest parameter's moment
    storage = min(sub_group_size(zero), per_rank) if zero is not None else m.largest_layer_params
    staged = 0 if offload else ranks * 4 * storage
    host["16-bit weights consolidated on rank 0" if consolidated >= staged else
         "optimizer shard storages staged by torch.save (one per rank)"] = max(consolidated, staged)
    out["save_host"] = host_phase(host, host_capacity,
                                  "checkpoint on the first node: 16-bit state dict on rank 0, then one storage per rank",
                                  "raise plan.cpu_ram_gb (sbatch --mem) or use fewer GPUs per node")

    # resume: transformers integrations/deepspeed.py:680-695 -> engine.load_checkpoint; each rank torch.loads
    # only its own shard to the host (engine.py:4802-4830, map_location='cpu'), then the optimizer's
    # load_state_dict (stage3.py:3540-3553 -> torch optim/optimizer.py:881-1018) copies every Adam moment to
    # the parameter's device (:964-1003, _cast) while the live moments stay referenced until __setstate__
    # (:1018): +8 B per trainable parameter of the rank on the GPU (none under offload: .to() of a CPU tensor
    # to the CPU is the tensor itself). The fp32 master weights are copied in place (stage3.py:3570-3571).
    # Before the first step: no batches.
    copies = 0 if offload else 8 * per_rank
    res = {MODEL_STATES: states, **({REFERENCE_COPY: ref_copy} if ref_copy else {}),
           **({"reduce bucket": ds["reduce bucket"]} if "reduce bucket" in ds else {}),
           "loaded Adam moments beside the live ones": copies}
    out["resume"] = gpu_phase(res, gpu_capacity, world, on_gpu,
                              "load the optimizer shards: Adam moments copied beside the live ones",
                              "offload the optimizer (train.zero.offload_optimizer={device: cpu}) or add GPUs")
    host = {"rank processes (1 GiB each: a floor, measured without CUDA)": ranks * INTERPRETER_BYTES}
    if cpu_states:
        host["offloaded optimizer states (DeepSpeed estimator, pinned)"] = cpu_states
    host["optimizer shards loaded (fp32 master + Adam m, v), every rank"] = ranks * 12 * per_rank
    out["resume_host"] = host_phase(host, host_capacity,
                                    "resume on one node: every rank's 12 B x its trainable parameters in RAM",
                                    "raise plan.cpu_ram_gb (sbatch --mem) or use fewer GPUs per node")

    fin = finalize_host_bytes(m, precision, peft)
    out["finalize"] = host_phase(fin["parts"], host_capacity,
                                 "verify" + (" + merge" if peft else "") + " after training, one CPU process",
                                 "request more memory (sbatch --mem) or run finalize on a larger host")
    q = quantize_host_bytes(m, precision, quant_type)
    out["quantize"] = host_phase(q["parts"], host_capacity, q["what"],
                                 "run `zerotune quantize` on a host with more RAM")
    return Phases(**out)


# llama.cpp's quantizer works in slabs of rows below this many bytes (src/llama-quant.cpp:42,
# LLAMA_QUANT_MAX_BUF_SIZE = 8 GiB; :1320-1322 nrows_slab), in the llama-cpp-python 0.3.36 sdist.
LLAMA_QUANT_MAX_BUF = 8 * GiB


def quantize_host_bytes(m: ModelShape, precision: str, quant_type: str) -> dict:
    """Peak host RAM of `zerotune quantize` (quantize.py): llama.cpp's convert_hf_to_gguf.py on the published
    model (in the training dtype), then for K-quants llama.cpp's quantizer on the f16 GGUF. Sources: the
    converter shipped in the llama-cpp-python 0.3.36 sdist (assets/llama.cpp after `make setup`).

    The converter is lazy (conversion/base.py:149, lazy unless --no-lazy): tensors are indexed from a
    memory-mapped safetensors file (:266-283; gguf-py/gguf/utility.py:286-287, np.memmap) and each is computed
    only when the writer writes it, one at a time, then dropped (gguf-py/gguf/gguf_writer.py:470-484,
    `ti.tensor.tofile(fout)`, `ti.tensor = None`; lazy.py:224-226). The mapped file's pages are page cache
    (clean, reclaimable under a memory limit), not counted. Per tensor, in anonymous memory:
      a dtype conversion: bf16 weights become fp32 first (conversion/base.py:1065-1066), 4 B/weight;
      the output: q8_0 and bf16 go through _apply_over_grouped_rows (gguf-py/gguf/quants.py:29-39), which
        holds every 16-row group's result in a list beside the concatenated output: 2 x the output; f16/f32
        are an astype (quants.py:57-62), a copy only when the dtype changes.
    K-quants: llama_model_quantize converts each slab of rows to fp32 and quantizes it into a work buffer
    (src/llama-quant.cpp:1320-1356): (4 + output) B/weight of the largest tensor, at most 8 GiB per slab.
    The largest tensor of a Llama model is the embedding or lm_head (vocab x hidden)."""
    q = QUANT_TYPES[quant_type.lower()]
    largest = max(m.vocab, m.intermediate) * m.hidden
    parts = {"interpreter + libraries (torch, gguf, tokenizer)": INTERPRETER_BYTES}
    out_type = quant_type.lower() if q.producer == "converter" else "f16"
    out_bpw = QUANT_TYPES[out_type].bpw / 8
    conv = 4 * largest if precision == "bf16" else 0
    if out_type in ("f16", "f32"):
        same = (out_type == "f16" and precision == "fp16") or (out_type == "f32" and precision == "fp32")
        out = 0 if (same and not conv) else int(out_bpw * largest)
    else:
        out = int(2 * out_bpw * largest)
    converter = conv + out
    what = f"convert_hf_to_gguf.py --outtype {out_type}, lazily, one tensor at a time"
    if q.producer == "quantizer":
        # per row: f16 source (memory-mapped from the f16 GGUF) + fp32 copy + output; only the last two are ours
        slab_weights = min(largest, int(LLAMA_QUANT_MAX_BUF // (2 + 4 + q.bpw / 8)))
        quantizer = int((4 + q.bpw / 8) * slab_weights)
        what += f", then llama.cpp's quantizer to {quant_type}"
        if quantizer > converter:
            parts[f"quantizer: fp32 slab + {quant_type} output (largest tensor)"] = quantizer
            return {"parts": parts, "peak_bytes": sum(parts.values()), "what": what}
    if conv:
        parts["largest tensor as fp32 (bf16 source)"] = conv
    grouped = out_type not in ("f16", "f32")
    parts[f"largest tensor's {out_type} output" + (" (+ its row-group list)" if grouped else "")] = out
    return {"parts": parts, "peak_bytes": sum(parts.values()), "what": what}
