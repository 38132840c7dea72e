"""Self-distilled replay's answering in the data step (data/replay.py), planned before it runs: the base model on
one device of the recipe's GPU kind answers data.replay's prompts in left-padded batches. Its peak against that
device, and its time. Reported by `zerotune plan`, never refused by preflight: by the time finetune starts it has
run.

The prompts' count and longest length come from the data manifest once `make data` has answered them (measured
with the tokenizer), and before that from the prompt file itself, bounded by its UTF-8 bytes (no tokenizer: planning
downloads nothing).
"""

from __future__ import annotations

import math

from .. import hardware
from .. import manifest as mf
from ..data.replay_prompts import load_prompts, prompt_file
from ..errors import UserError
from ..layout import layout
from . import time as timemodel
from .finalize_ram import INTERPRETER_BYTES
from .memory import GiB, ModelShape
from .phases import generation_parts, gpu_phase
from .records import Replay, ReplayRun, ReplayTime
from .target import Target

# Share of the GPU's memory bandwidth that HF's eager generate() turns into weight reads per decode step, at
# eval.batch_size 8 in fp16. An assumption, not measured on a V100. Why 0.6: a decode step reads every weight once
# through skinny matmuls (cuBLAS streams them at roughly 80-90% of peak) between which Python launches ~40 small
# kernels per layer (norms, RoPE, cache concat, the padding mask, SDPA, residual adds); on a V100 the 8B's 16 GB
# of fp16 weights take 17.8 ms at 900 GB/s, longer than those launches, so the gaps cost a fraction, not a
# multiple. Anchor: lmdeploy#210 measured HF transformers Llama-2-7B at 34 ms per token at batch 1 on an A10
# (600 GB/s, 13.5 GB of weights: 22.5 ms at full bandwidth), 0.66. On A100/H100 the weights take 5-8 ms and the
# launches dominate: the estimate is optimistic there (a per-step floor would be the next term to model).
REPLAY_DECODE_EFFICIENCY = 0.6

# A bound on the chat template's tokens around the prompts' text, without the tokenizer. Byte-level BPE (Llama 3,
# SmolLM2, Qwen, GPT-2 style: every byte is a base token, every token at least one byte) never gives more tokens than
# UTF-8 bytes, so a prompt's content costs at most its byte length; the template adds a fixed part and a part per
# message. Measured with the real tokenizers (tests/test_plan.py): fixed, Llama 3.1-Instruct's default system header
# with its date (<|begin_of_text|>...Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>)
# 26 tokens + the assistant header 4 = 30; SmolLM2's default system block 21 + 4 = 25; per message 5 in both (start,
# role, end of header or newline, end of turn). Templates with longer default system prompts or tool descriptions
# are not covered.
REPLAY_TEMPLATE_TOKENS = 40
REPLAY_TOKENS_PER_MESSAGE = 8


def replay_prompt_bound(rows: list[dict]) -> int:
    """A bound on the tokens of the longest templated prompt of `rows`: the UTF-8 bytes of its messages' contents +
    the template's fixed and per-message overhead (REPLAY_TEMPLATE_TOKENS, REPLAY_TOKENS_PER_MESSAGE)."""
    return max(sum(len(msg["content"].encode("utf-8")) for msg in row["messages"]) + REPLAY_TEMPLATE_TOKENS
               + REPLAY_TOKENS_PER_MESSAGE * len(row["messages"]) for row in rows)


def replay_plan(m: ModelShape, *, prompts: int, batch: int, prompt_tokens: int, max_new_tokens: int, e: int,
                on_gpu: bool, capacity: int, bandwidth_gbs: float | None = None, peak_tflops: float | None = None,
                mfu: float | None = None) -> ReplayRun:
    """Self-distilled replay's generation (data/replay.py answer -> answering.hf_answers): the whole model on one
    device in the generation dtype (e bytes; not ZeRO-partitioned: load_hf moves the full model there), `batch`
    left-padded prompts per generate() call, longest first, so the first batch is the widest: `prompt_tokens` (the
    longest prompt) x `batch` rows, up to `max_new_tokens` each (phases.generation_parts). One process: CUDA
    context and fragmentation as for any GPU phase, no NCCL. CPU target (on_gpu False): host RAM (the interpreter
    and libraries included), time unknown. Not modelled: host RAM while from_pretrained loads the model before
    moving it to the GPU (about the weights again).

    Time (GPU): per batch, every decode step reads all weights once plus the KV cache it attends over, at
    bandwidth x REPLAY_DECODE_EFFICIENCY, or computes 2 x params FLOPs per row at peak x mfu, whichever is longer
    (memory-bound at small batches); max_new_tokens such reads per batch (the prefill's own read is the first), plus
    the prefill's 2 x params x rows x prompt FLOPs at peak x mfu (an upper bound: it counts lm_head for every
    token, logits_to_keep=1 computes it for the last). Model load and tokenization are not counted."""
    rows = max(1, min(batch, prompts))
    weights = m.n_params * e
    prefill, decode = generation_parts(m, rows=rows, prompt=prompt_tokens, new_tokens=max_new_tokens, e=e,
                                       liger=False, padded=rows > 1, on_gpu=on_gpu)
    tensors = {f"weights ({8 * e}-bit, whole model, one device)": weights,
               **(prefill if sum(prefill.values()) >= sum(decode.values()) else decode)}
    if not on_gpu:  # host RAM holds the process itself too, as in the other host phases
        tensors["interpreter + libraries"] = INTERPRETER_BYTES
    phase = gpu_phase(tensors, capacity, 1, on_gpu,
                      f"greedy generate, {rows} x prompt <= {prompt_tokens:,} + {max_new_tokens} new tokens, KV cache",
                      "lower eval.batch_size (prompts per generate() call) or data.replay.max_new_tokens, or shorten "
                      "the longest prompts")
    batches = math.ceil(prompts / batch)
    run = ReplayRun(phase=phase, rows=rows, batches=batches, generated_tokens_max=prompts * max_new_tokens)
    if not (on_gpu and bandwidth_gbs and peak_tflops and mfu):
        return run
    kv = 2 * m.layers * m.kv_dim * e
    flops_s = peak_tflops * 1e12 * mfu
    read_s = bandwidth_gbs * 1e9 * REPLAY_DECODE_EFFICIENCY
    steps = sum(max((weights + kv * rows * (prompt_tokens + t)) / read_s, 2 * m.n_params * rows / flops_s)
                for t in range(max_new_tokens))
    prefill_s = 2 * m.n_params * rows * prompt_tokens / flops_s
    return ReplayRun(phase=phase, rows=rows, batches=batches, generated_tokens_max=prompts * max_new_tokens,
                     time=ReplayTime(seconds=batches * (steps + prefill_s), decode_s=batches * steps,
                                     prefill_s=batches * prefill_s, seconds_per_step=steps / max_new_tokens, mfu=mfu,
                                     efficiency=REPLAY_DECODE_EFFICIENCY,
                                     memory_bound=weights / read_s >= 2 * m.n_params * rows / flops_s))


def plan_replay(t: Target) -> tuple[Replay | None, str | None]:
    """(the plan, None), or (None, why it cannot be planned) when the prompt file cannot be read (the data step
    says so too); (None, None) without data.replay. The base model on one device of the recipe's GPU kind, in the
    precision data/replay.py picks there (hardware.choose's auto, fp16 on V100), eval.batch_size prompts per
    generate() call; on a CPU target, host RAM in fp32."""
    r, g = t.r, t.g
    rp = r.data.replay
    if rp is None:
        return None, None
    try:
        rows = load_prompts(r)  # data.replay.limit applied
    except UserError as e:
        return None, str(e)
    measured = (mf.read(layout(r).data_manifest) or {}).get("replay") or {}
    if measured.get("prompts_sha256") == mf.sha256(prompt_file(r)) and measured.get("prompt_tokens_max"):
        prompt, source = measured["prompt_tokens_max"], "measured by `make data`"
    else:
        prompt, source = replay_prompt_bound(rows), "bound from the prompts' UTF-8 bytes until `make data`"
    precision = hardware.choose(g, fa2_installed=False, family=t.shape.fam).precision  # as data/replay.py picks it
    capacity = int(g.usable_gib * GiB) if t.on_gpu else int(r.plan.cpu_ram_gb * 1e9)  # one process, the node's RAM

    def run(batch: int, **timing) -> ReplayRun:
        return replay_plan(t.shape, prompts=len(rows), batch=batch, prompt_tokens=prompt,
                           max_new_tokens=rp.max_new_tokens, e=hardware.dtype_bytes(precision), on_gpu=t.on_gpu,
                           capacity=capacity, **timing)

    # the GPU's memory bandwidth: the time model's sourced figure for the cluster type around it (planner/time.py)
    hbm = timemodel.CLUSTERS[g.cluster].hbm if g.cluster else None
    own = run(r.eval.batch_size, bandwidth_gbs=hbm, peak_tflops=g.peak_tflops, mfu=t.mfu)
    # what to suggest when it does not fit: the largest smaller eval.batch_size that does (None: fits, or none does)
    largest = None if own.phase.fits else next(
        (b for b in range(min(r.eval.batch_size, len(rows)) - 1, 0, -1) if run(b).phase.fits), None)
    return Replay(prompts=len(rows), path=rp.path, prompt_limit=rp.limit, prompt_tokens=prompt,
                  prompt_tokens_from=source, batch_size=r.eval.batch_size, max_new_tokens=rp.max_new_tokens,
                  precision=precision, device=g.name, run=own, largest_batch_that_fits=largest), None
