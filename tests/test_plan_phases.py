"""Every phase of a training job is planned (issue 29): each term against a hand count on a small shape, the 8B
recipe through all phases on a V100 as PyTorch sizes it (31.75 GiB), and disk per event counting what a
requeued run already holds."""

from __future__ import annotations

import json
import math
import shutil
from collections import namedtuple

import pytest

from zerotune.config import load_recipe
from zerotune.planner import calibration
from zerotune.planner.disk import disk_events
from zerotune.planner.memory import GiB, ModelShape, memory_breakdown, prefetched_batches_bytes
from zerotune.planner.compute import compute_plan
from zerotune.planner.gate import disk_preflight, preflight
from zerotune.planner.phases import (eval_loss_bytes, generation_parts, nograd_layer_bytes, phase_plan,
                                     quantize_host_bytes)
from zerotune.planner.records import Phases, Plan
from zerotune.planner.replay import REPLAY_DECODE_EFFICIENCY, replay_plan
from zerotune.planner.report import format_plan
from zerotune.planner.target import PlanError

# hidden 64, 4 heads of 16 (q 64), 2 KV heads (kv 32), intermediate 128, vocab 256
SMALL = ModelShape(n_params=100_000, largest_layer_params=16_384, hidden=64, layers=2, heads=4, kv_heads=2,
                   head_dim=16, intermediate=128, vocab=256, max_positions=4096, config_path="")
N8B = 8_030_261_248
PHASES = ["train_step", "validation", "samples", "save", "save_host", "resume", "resume_host", "finalize", "quantize"]
usage = namedtuple("usage", "total used free")


def names(ph: Phases) -> list[str]:
    return [n for n, _ in ph.items()]


def small_train(grad_accum: int = 5, liger: bool = False, micro: int = 2, seq: int = 8) -> dict:
    return memory_breakdown(SMALL, seq=seq, micro=micro, precision="fp16", attention="sdpa", liger=liger,
                            checkpointing=True, packing=True, zero=None, gpus_per_node=1, nodes=1,
                            grad_accum=grad_accum)


@pytest.fixture(scope="module")
def plan8b():
    return compute_plan(load_recipe("llama8b_zero3"))


# --- the training step: every prefetched micro-batch ---------------------------------------------------------

def test_prefetched_micro_batches_are_ga_x_micro_x_seq_x_three_int64():
    assert prefetched_batches_bytes(micro=2, seq=8, grad_accum=5) == 5 * 2 * 8 * 3 * 8 == 1920


def test_training_step_counts_the_step_s_micro_batches_beside_the_one_in_flight():
    # the in-flight input_ids (8 B x 2 x 8) are already with the activations (the embedding saves them)
    assert small_train(5)["parts"]["GA micro-batches (prefetched)"] == 1920 - 8 * 2 * 8
    assert small_train(1)["parts"]["GA micro-batches (prefetched)"] == 3 * 16 * 8 - 8 * 16


def test_step_boundary_counts_two_steps_of_batches_only_beyond_the_freed_activations():
    mem = small_train(100_000)
    freed = sum(mem["parts"][k] for k in ("checkpointed layer inputs", "one-layer recompute", "attention mask",
                                          "logits + loss"))
    assert mem["parts"]["next step's micro-batches (step boundary)"] + freed == prefetched_batches_bytes(2, 8, 100_000)
    assert "next step's micro-batches (step boundary)" not in small_train(5)["parts"]


def test_8b_prefetched_batches(plan8b):
    # 480 micro-batches of 16,384 tokens: 480 x 16,384 x 3 x 8 B = 0.176 GiB, less the in-flight input_ids
    assert plan8b.memory.parts["GA micro-batches (prefetched)"] == 480 * 16384 * 3 * 8 - 16384 * 8


# --- no-grad forward terms -----------------------------------------------------------------------------------

def test_nograd_layer_by_hand():
    # T=8, e=2: residual e T h = 1024; q, k, v = 2 x 8 x (64 + 2 x 32) = 2048
    hf = nograd_layer_bytes(SMALL, 8, 2, liger=False)
    assert hf["residual"] == 1024
    # after attention the post-attention sum (`residual`) sits beside the layer input: + 1024 in norm and mlp
    assert hf["blocks"] == {"norm": 8 * 8 * 64 + 1024,                # fp32 input + its pow(2)
                            "attention": 1024 + 2048 + 3 * 2 * 8 * 64,  # RoPE: three q-sized temporaries
                            "mlp": 1024 + 3 * 2 * 8 * 128 + 1024}       # gate, up, product
    assert hf["peak"] == 8192
    # a packed mask: k, v repeated to 4 heads (2 x 1024) + the 8 x 8 mask in fp16 + output and its copy
    masked = nograd_layer_bytes(SMALL, 8, 2, mask=(1, 8, 8), liger=False)
    assert masked["blocks"]["attention"] == 1024 + 2048 + (2048 + 2048 + 2 * 8 * 8) == 7296
    assert masked["peak"] == 8192  # still the MLP block
    # on a GPU the memory-efficient kernel pads the float mask to aligned columns: 8 -> 16, a second copy
    assert nograd_layer_bytes(SMALL, 8, 2, mask=(1, 8, 8), liger=False, on_gpu=True)["blocks"]["attention"] == (
        7296 + 2 * 8 * 16)
    assert nograd_layer_bytes(SMALL, 16, 2, mask=(1, 16, 16), liger=False, on_gpu=True)["blocks"]["attention"] == (
        nograd_layer_bytes(SMALL, 16, 2, mask=(1, 16, 16), liger=False)["blocks"]["attention"])  # aligned: no pad
    lg = nograd_layer_bytes(SMALL, 8, 2, liger=True)
    assert lg["blocks"]["norm"] == 1024 + 4 * 8 + 1024  # output + 1/rms, beside the post-attention sum
    assert lg["blocks"]["attention"] == 1024 + 2048 + max(2 * 8 * (64 + 32), 2 * 2 * 8 * 64) == 5120


def test_generation_layer_terms_by_hand():
    # left-padded prefill of 3 rows x 5 tokens (T = 15), e = 2, with a KV cache: k and v are in the cache by the time
    # SDPA runs, so the block is the normed input + max(q, k, v + RoPE's temporaries, q + SDPA's tensors)
    T, e = 15, 2
    rope = e * T * max(3 * 64, 64 + 3 * 32)
    sdpa = 2 * e * T * 64 + 2 * e * 3 * 5 * 64 + e * 3 * 5 * 5  # output + copy, repeated k, v, the (3, 1, 5, 5) mask
    cpu = nograd_layer_bytes(SMALL, T, e, mask=(3, 5, 5), liger=False, cached=True)
    assert cpu["blocks"]["attention"] == e * T * 64 + max(e * T * 128 + rope, e * T * 64 + sdpa) == 11670
    gpu = nograd_layer_bytes(SMALL, T, e, mask=(3, 5, 5), liger=False, cached=True, on_gpu=True)
    assert gpu["blocks"]["attention"] == e * T * 64 + e * T * 64 + sdpa + e * 3 * 5 * 16  # + the padded copy
    # a decode step (one token per row over a cache of 12): the query is regrouped, not k and v repeated
    step = nograd_layer_bytes(SMALL, 3, e, mask=(3, 1, 12), liger=False, cached=True)
    assert step["blocks"]["attention"] == e * 3 * 64 + max(e * 3 * 128 + e * 3 * 192, e * 3 * 64 + 2 * e * 3 * 64
                                                            + e * 3 * 12)
    # as many KV heads as query heads: repeat_kv returns k itself, no copy (Liger's RoPE, so that SDPA leads)
    mha = ModelShape(**{**SMALL.__dict__, "kv_heads": 4})
    assert (nograd_layer_bytes(mha, 8, 2, mask=(1, 8, 8), liger=True)["blocks"]["attention"]
            == 1024 + 2 * 8 * 192 + (2048 + 2 * 8 * 8))


def test_generation_parts_by_hand():
    # 3 left-padded rows of 8 tokens, 4 new tokens, e = 2: KV 2 layers x K, V x 32 x 2 B = 256 B per token
    prefill, decode = generation_parts(SMALL, rows=3, prompt=8, new_tokens=4, e=2, liger=False, padded=True,
                                       on_gpu=False)
    assert prefill["KV cache (prompt)"] == 256 * 24
    assert prefill["token tensors (prompt ids + mask, position ids, ids copy)"] == 4 * 8 * 24
    assert prefill["attention mask (bool, rows x prompt x prompt)"] == 3 * 8 * 8
    assert prefill["rotary cos/sin"] == 2 * 24 * 16 * 2  # per row: generate's position ids are (rows, prompt)
    assert prefill["one layer, no grad (mlp block)"] == 2 * 24 * 64 + 3 * 2 * 24 * 128 + 2 * 24 * 64
    # decode: the cache at prompt + new - 1 = 11; the previous step's fp32 logits beside the last step's forward,
    # which here outweighs the step's logits and their copy (a 256-token vocabulary)
    assert decode["KV cache (prompt + answer)"] == 256 * 3 * 11
    assert decode["previous step's fp32 logits"] == 4 * 3 * 256
    assert decode["token tensors (prompt's, running ids, masks, positions)"] == 3 * 8 * 24 + 4 * 8 * 3 * 12
    assert decode["decode step: cache concat (one layer)"] == 32 * 2 * 3 * 11
    assert decode["decode step: attention mask (bool, rows x cache)"] == 3 * 11
    # a large vocabulary: the step's logits + their fp32 copy (copy=True) outweigh the step's forward
    big = ModelShape(**{**SMALL.__dict__, "vocab": 128_256})
    _, decode = generation_parts(big, rows=3, prompt=8, new_tokens=4, e=2, liger=False, padded=True, on_gpu=False)
    assert decode["last-token logits + fp32 copy"] == 3 * 128_256 * (2 + 4)
    # one unpadded row (in-training samples): no mask anywhere, and generate() drops the all-ones mask
    prefill, decode = generation_parts(SMALL, rows=1, prompt=8, new_tokens=4, e=2, liger=False, padded=False,
                                       on_gpu=False)
    assert "attention mask (bool, rows x prompt x prompt)" not in prefill
    assert not any(k.startswith("decode step: attention mask") for k in decode)
    assert decode["token tensors (prompt's, running ids, masks, positions)"] == 3 * 8 * 8 + 2 * 8 * 12


def test_replay_plan_by_hand():
    # 7 prompts, 3 per batch: 3 batches of (at most) 3 rows x 8 tokens; SMALL in fp16 on a GPU
    kw = dict(prompts=7, batch=3, prompt_tokens=8, max_new_tokens=4, e=2, on_gpu=True, capacity=GiB)
    p = replay_plan(SMALL, **kw)
    prefill, decode = generation_parts(SMALL, rows=3, prompt=8, new_tokens=4, e=2, liger=False, padded=True,
                                       on_gpu=True)
    assert sum(prefill.values()) > sum(decode.values())
    assert p.phase.parts["weights (16-bit, whole model, one device)"] == 2 * SMALL.n_params
    assert p.phase.peak_bytes == with_overheads(2 * SMALL.n_params + sum(prefill.values()))  # one process: no NCCL
    assert p.phase.fits and p.phase.limit == "gpu" and p.phase.capacity_bytes == GiB
    assert (p.rows, p.batches, p.generated_tokens_max, p.time) == (3, 3, 28, None)  # no bandwidth: no time
    assert not replay_plan(SMALL, **{**kw, "capacity": 2 * SMALL.n_params}).phase.fits
    # memory-bound: each of the 4 weight reads per batch also reads the cache of 3 rows x (8 + t) tokens, at 60%
    # of 100 GB/s; prefill 2 x params x 3 x 8 FLOPs at 1 TFLOPS x 0.5
    t = replay_plan(SMALL, **kw, bandwidth_gbs=100.0, peak_tflops=1.0, mfu=0.5)
    reads = sum(2 * SMALL.n_params + 256 * 3 * (8 + i) for i in range(4)) / (100e9 * REPLAY_DECODE_EFFICIENCY)
    prefill_s = 2 * SMALL.n_params * 3 * 8 / 0.5e12
    assert t.time.memory_bound and t.time.seconds == pytest.approx(3 * (reads + prefill_s))
    # compute-bound when the FLOPs of a step outlast its reads: 2 x params x rows per step
    c = replay_plan(SMALL, **kw, bandwidth_gbs=1e6, peak_tflops=1e-3, mfu=0.5)
    assert not c.time.memory_bound and c.time.decode_s == pytest.approx(3 * 4 * 2 * SMALL.n_params * 3 / 0.5e9)
    # a single prompt: one row, no padding (nothing to pad against)
    assert replay_plan(SMALL, **{**kw, "prompts": 1}).rows == 1


def test_eval_loss_by_hand():
    labels = 8 * 9 + 8 * 8  # padded, then the shifted contiguous copy
    # Liger: ceil(256 / 64) = 4 -> chunk next_pow2(ceil(8 / 4)) = 2 rows x 256 x 2 B, zeroed input grad 2 x 8 x 64,
    # fp32 loss per token, the target mask
    assert eval_loss_bytes(SMALL, 8, 2, fused=True)[0] == 2 * 256 * 2 + 2 * 8 * 64 + 4 * 8 + 8 + labels == 2224
    # HF: fp16 logits + fp32 copy + fp32 log-softmax = 10 B x vocab x tokens
    assert eval_loss_bytes(SMALL, 8, 2, fused=False)[0] == 10 * 8 * 256 + labels == 20616


@pytest.mark.parametrize("tokens", [1, 7, 512, 16384, 100_000])
def test_eval_chunk_is_liger_s_own(tokens):
    import triton

    m = ModelShape(**{**SMALL.__dict__, "hidden": 4096, "vocab": 128_256})
    chunk = min(tokens, triton.next_power_of_2(triton.cdiv(tokens, triton.cdiv(m.vocab, m.hidden))))
    labels = 8 * (tokens + 1) + 8 * tokens  # chunk: ops/fused_linear_cross_entropy.py:103-105
    want = chunk * m.vocab * 2 + 2 * tokens * m.hidden + 5 * tokens + labels
    assert eval_loss_bytes(m, tokens, 2, fused=True)[0] == want


# --- phases on the small shape -------------------------------------------------------------------------------

def small_phases(liger=False, **kw):
    train = small_train(5, liger=liger)
    args = dict(m=SMALL, train=train, precision="fp16", attention="sdpa", liger=liger, packing=True, zero=None,
                world=1, gpus_per_node=1, on_gpu=True, seq=8, micro=2, grad_accum=5, trainable=SMALL.n_params,
                peft=None, gpu_capacity=GiB, host_capacity=4 * GiB, validation_runs=True, samples=2,
                max_new_tokens=4, quant_type="q8_0")
    return phase_plan(**{**args, **kw})


def with_overheads(tensors: int) -> int:
    # world 1: no NCCL; 5% fragmentation + the CUDA context (calibration.overheads)
    return tensors + int(calibration.LIVE_FRAGMENTATION * tensors) + calibration.CUDA_CONTEXT_BYTES


def test_small_phases_by_hand():
    ph = small_phases()
    assert names(ph) == PHASES and ph.reference is None
    states, batches = 16 * SMALL.n_params, 1920  # no DeepSpeed: 16 B/param; 5 x 2 x 8 x 3 x 8 B
    # validation: row of 8, the packed 8 x 8 bool mask, cos/sin 2 x 8 x 16 x 2 B; the output layer (1024 + 20616)
    # outweighs the largest layer block (1024 + 7296 with the mask)
    val = states + batches + 3 * 8 * 8 + 64 + 512 + (1024 + 20616)
    assert ph.validation.peak_bytes == with_overheads(val)
    # samples: prefill of an 8-token prompt: KV 2 layers x 2 x 32 x 2 B x 8 + ids and mask, generate's position ids
    # and ids copy + cos/sin + the MLP block over the residual stream (two copies from layer 1 on: inputs_embeds and
    # the layer's input; no mask: is_causal) beats the decode's cache of 11 tokens
    samples = states + batches + 2 * 2 * 32 * 2 * 8 + 4 * 8 * 8 + 512 + (2 * 1024 + 8192)
    assert ph.samples.peak_bytes == with_overheads(samples)
    assert ph.save.peak_bytes == with_overheads(states + batches)
    # resume: Adam m, v loaded beside the live ones; before the first step, no batches
    assert ph.resume.peak_bytes == with_overheads(states + 8 * SMALL.n_params)
    # host: one rank; torch.save stages the largest parameter's fp32 moment (no ZeRO), the 16-bit weights
    # (2 B x 100,000) are larger
    assert ph.save_host.parts == {"rank processes (1 GiB each: a floor, measured without CUDA)": GiB,
                                        "16-bit weights consolidated on rank 0": 2 * SMALL.n_params}
    assert ph.resume_host.peak_bytes == GiB + 12 * SMALL.n_params
    assert all(getattr(ph, k).limit == "host" for k in ("save_host", "resume_host", "finalize", "quantize"))
    assert all(getattr(ph, k).limit == "gpu" and getattr(ph, k).capacity_bytes == GiB
               for k in ("train_step", "validation", "samples", "save", "resume"))


def test_small_validation_with_liger_has_no_logits():
    ph = small_phases(liger=True)
    # fused loss 2224 + final norm 1024 < two residual copies 2048 + the MLP block 8192 (attention with the
    # mask: 7296)
    assert ph.validation.parts["residual stream"] == 2 * 1024
    assert ph.validation.parts["one layer, no grad (mlp block)"] == 1024 + 3 * 2 * 8 * 128 + 1024
    assert not any("output layer" in k for k in ph.validation.parts)


def test_phases_that_do_not_run_are_marked():
    ph = small_phases(validation_runs=False, samples=0)
    assert not ph.validation.runs and not ph.samples.runs and ph.save.runs


def test_quantize_host_by_hand():
    big = ModelShape(**{**SMALL.__dict__, "hidden": 4096, "intermediate": 14336, "vocab": 128_256})
    largest = 128_256 * 4096  # embedding / lm_head
    # q8_0 from fp16: the 34-byte blocks per 32 weights, held twice (row-group list + concatenated output)
    assert quantize_host_bytes(big, "fp16", "q8_0")["peak_bytes"] == GiB + int(2 * 8.5 / 8 * largest)
    # bf16 weights are made fp32 first
    assert quantize_host_bytes(big, "bf16", "q8_0")["peak_bytes"] == GiB + 4 * largest + int(2 * 8.5 / 8 * largest)
    # f16 from fp16: written straight from the memory-mapped file
    assert quantize_host_bytes(big, "fp16", "f16")["peak_bytes"] == GiB
    # K-quant: the quantizer's fp32 slab + output for the whole largest tensor (under its 8 GiB slab)
    assert quantize_host_bytes(big, "fp16", "q4_k_m")["peak_bytes"] == GiB + int((4 + 4.85 / 8) * largest)


# --- the 8B recipe on 8 x V100 ---------------------------------------------------------------------------------

def test_8b_every_phase_planned_and_fits_a_v100_as_pytorch_sizes_it(plan8b):
    ph = plan8b.phases
    assert names(ph) == PHASES
    assert plan8b.cluster.capacity_bytes == int(31.75 * GiB)
    for name, p in ph.items():
        assert p.runs and p.fits, (name, p.peak_bytes / GiB)
        assert p.peak_bytes == sum(p.parts.values())
        assert p.capacity_bytes == (int(31.75 * GiB) if p.limit == "gpu" else int(384e9))
    assert ph.train_step.peak_bytes == plan8b.memory.peak_bytes


def test_8b_save_and_resume_terms(plan8b):
    ph = plan8b.phases
    per_rank = math.ceil(N8B / 8)
    assert ph.resume.parts["loaded Adam moments beside the live ones"] == 8 * per_rank
    loaded = ph.resume_host.parts["optimizer shards loaded (fp32 master + Adam m, v), every rank"]
    assert loaded == 8 * 12 * per_rank
    assert ph.save_host.parts["16-bit weights consolidated on rank 0"] == 2 * N8B
    # between steps the fp32 gradient sub-group is freed (stage3.py _release_sub_group)
    assert "fp32 grad sub-group" not in ph.save.parts


def test_8b_validation_without_liger_materialises_the_logits():
    p = compute_plan(load_recipe("llama8b_zero3", ["train.liger=off"]))
    val = p.phases.validation
    loss = eval_loss_bytes(ModelShape(**{**SMALL.__dict__, "hidden": 4096, "vocab": 128_256}), 16384, 2, False)[0]
    assert loss == 10 * 16384 * 128_256 + 8 * 16385 + 8 * 16384
    assert not val.fits and val.peak_bytes > 38 * GiB


def test_preflight_names_the_validation_phase_and_the_fix():
    with pytest.raises(PlanError, match=r"validation: \d+\.\d GiB of 31\.75 per GPU .*set train\.liger=on"):
        r = load_recipe("llama8b_zero3", ["train.liger=off"])
        preflight(compute_plan(r), r)


def test_offload_and_lora_recipes_plan_every_phase():
    for name in ("llama8b_zero3_offload", "llama8b_lora_zero3"):
        p = compute_plan(load_recipe(name))
        assert names(p.phases) == PHASES and all(x.fits for _, x in p.phases.items()), name
    off = compute_plan(load_recipe("llama8b_zero3_offload")).phases
    assert off.resume.parts["loaded Adam moments beside the live ones"] == 0  # the moments stay in RAM
    assert "offloaded optimizer states (DeepSpeed estimator, pinned)" in off.resume_host.parts


def test_plan_json_and_table_show_the_phases(tmp_path, capsys, plan8b):
    from zerotune.plan import plan_main

    plan_main(load_recipe("tiny", [f"output_dir={tmp_path}"]), as_json=True)
    assert names(Plan.from_json(json.loads(capsys.readouterr().out)).phases) == PHASES
    text = format_plan(plan8b)
    assert "every phase of the job" in text
    for name in PHASES:
        assert f"\n  {name} " in text, name


# --- disk per event -------------------------------------------------------------------------------------------

FRESH = {"checkpoints": 0, "checkpoint_steps": [], "checkpoint_bytes": 0, "model_staging_bytes": 0}


def test_disk_events_by_hand():
    d = disk_events(checkpoint_bytes=10, model_bytes=3, adapter_bytes=None, save_total_limit=2, save_steps=1,
                    total_steps=None, now=FRESH)
    assert [(e["event"], e["checkpoints_held"], e["bytes"]) for e in d["events"]] == [
        ("first save", 0, 10), ("save at save_total_limit", 2, 30), ("finalize staging", 2, 23)]
    assert (d["peak_bytes"], d["checkpoints_at_once"], d["needed_free_bytes"]) == (30, 3, 30)
    # a run that already holds two committed checkpoints (20 B): the next save needs one more of room
    now = {"checkpoints": 2, "checkpoint_steps": [4, 5], "checkpoint_bytes": 20, "model_staging_bytes": 0}
    d = disk_events(checkpoint_bytes=10, model_bytes=3, adapter_bytes=None, save_total_limit=2, save_steps=1,
                    total_steps=None, now=now)
    assert [(e["event"], e["needed_free_bytes"]) for e in d["events_now"]] == [("save", 10), ("finalize staging", 3)]
    assert (d["needed_free_bytes"], d["needed_at"]) == (10, "save")
    # one save in the whole run: one checkpoint, then the model beside it
    d = disk_events(checkpoint_bytes=10, model_bytes=3, adapter_bytes=None, save_total_limit=2, save_steps=1,
                    total_steps=1, now=FRESH)
    assert [(e["event"], e["bytes"]) for e in d["events"]] == [("first save", 10), ("finalize staging", 13)]
    # PEFT: the adapter (1) in model.tmp/ beside the merged model staged by finalize
    d = disk_events(checkpoint_bytes=10, model_bytes=3, adapter_bytes=1, save_total_limit=1, save_steps=1,
                    total_steps=5, now=FRESH)
    assert d["events"][-1] == {"event": "finalize staging", "checkpoints_held": 1, "bytes": 10 + 3 + 1}


def _commit(ckpt, size: int) -> None:
    from zerotune import manifest as mf
    from zerotune.checkpoint import MARKER, file_sizes

    ckpt.mkdir(parents=True)
    with open(ckpt / "shard.pt", "wb") as f:
        f.truncate(size)  # sparse: the apparent size without the bytes
    mf.write(ckpt / MARKER, {"step": int(ckpt.name.split("-")[1]), "files": file_sizes(ckpt)})


def test_requeued_run_counts_its_committed_checkpoints(tmp_path, monkeypatch):
    run = tmp_path / "run"
    r = load_recipe("llama8b_zero3", [f"output_dir={run}"])
    C = compute_plan(r).disk.checkpoint_bytes  # 104.7 GiB; a fresh run needs 3 x C = 314 GiB
    for step in (4, 5):
        _commit(run / "checkpoints" / f"checkpoint-{step}", C)
    (run / "checkpoints" / "checkpoint-6").mkdir()  # a partial save: not committed, not counted as held

    # below a fresh run's need, above the next save's: the run goes on
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**40, 0, 120 * GiB))
    p = compute_plan(r)
    disk_preflight(p, r, run)  # no error
    d = p.disk
    assert d.held.checkpoints == 2 and d.held.checkpoint_steps == (4, 5) and d.needed_at == "save"
    assert d.needed_free_bytes == pytest.approx(C, abs=4096)  # less the markers' few bytes
    assert d.peak_bytes == 3 * C > 120 * GiB
    assert "this run holds 2 committed checkpoint(s)" in format_plan(compute_plan(r))

    # below the next save's need: refused, naming the event, what is held and what to change
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**40, 0, 100 * GiB))
    with pytest.raises(PlanError, match=r"100\.0 GiB free; this run needs 104\.7 GiB more at its save \(its 2 "
                                        r"committed checkpoint\(s\) \(209\.4 GiB\) already counted.*save_total_limit"):
        disk_preflight(compute_plan(r), r, run)
