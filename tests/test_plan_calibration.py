"""Planner calibration against published measurements (issue 19, "Planner calibration").

Every row below is a number someone measured and published; the test builds the matching
configuration and holds the planner to issue 19's goal: within 10% of the measurement and never more
than 5% below it. No public measurement was found for the exact configuration the issue's held-out
set used (V100-32GB, HF Trainer + ZeRO-3, 1B/8B Llama, micro-batch 1, 512 tokens): the issue's own
relative statements about it are checked separately (ISSUE_19), against the planner before calibration.
"""

from __future__ import annotations

import json

import pytest

from zerotune.config import REPO_ROOT
from zerotune.planner import calibration as cal
from zerotune.planner.memory import GiB, memory_breakdown, offload_handoff_bytes, shape_of

MiB = 2 ** 20
TOL, FLOOR = 0.10, 0.05  # issue 19: within +-10%, never below by more than 5%


def within_goal(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= TOL * measured and predicted >= (1 - FLOOR) * measured


# --- Published measurements -------------------------------------------------------------------
# Peak reserved / peak allocated with sharded parameters (the caching allocator's reserve).
RESERVE_RATIOS = [
    # (source, GPU, setup, reserved GB, allocated GB, what was read)
    ("deepspeedai/DeepSpeed#522", "?", "ZeRO-2, an earlier run in the thread", 6.39, 5.09, "see_memory_usage CA / Max_MA"),
    ("deepspeedai/DeepSpeed#522", "?", "ZeRO-2 cpu_offload, grad ckpt", 6.68, 5.31, "see_memory_usage CA / Max_MA"),
    ("NiuTrans/Vision-LLM-Alignment#9", "?", "ZeRO-3, Llama-3.2-Vision, after ZeRO init", 15.42, 12.26,
     "see_memory_usage CA / Max_MA"),
    ("meta-llama/llama-cookbook PR #41", "4xA100-40GB", "FSDP LoRA Llama-2-7B", 32.67, 25.86, "peak reserved / active"),
    ("meta-llama/llama-cookbook PR #41", "4xA100-40GB", "FSDP LoRA Llama-2-7B, limit_all_gathers", 27.36, 20.20,
     "peak reserved / active"),
    ("meta-llama/llama-cookbook PR #41", "4xA100-40GB", "FSDP LoRA Llama-2-7B, no logits kept", 19.36, 15.22,
     "peak reserved / active"),
    ("meta-llama/llama-cookbook PR #165", "8 GPUs", "FSDP full Llama-7B, use_cache=False", 19.52, 14.93,
     "peak reserved / active"),
]


@pytest.mark.parametrize("src,gpu,setup,reserved,allocated,how", RESERVE_RATIOS)
def test_reserved_over_allocated_matches_published_ratio(src, gpu, setup, reserved, allocated, how):
    v = cal.views(int(allocated * GiB), {}, gpu_is_cuda=True)
    assert within_goal(v["reserved"] / v["allocated"], reserved / allocated), (src, setup)


def test_memory_outside_allocator_matches_v100_oom_report():
    # meta-llama/llama-cookbook#234: Llama-2-7B, 8 x V100-16GB, FSDP fp16, torchrun 8 ranks. At OOM:
    # "this process has 15.76 GiB memory in use. Of the allocated memory 13.76 GiB is allocated by
    # PyTorch, and 540.64 MiB is reserved by PyTorch but unallocated" -> outside the allocator:
    outside = 15.76 * GiB - 13.76 * GiB - 540.64 * MiB
    extra = cal.overheads(int(13.76 * GiB), world=8, gpu_is_cuda=True)
    predicted = sum(v for k, v in extra.items() if "outside allocator" in k)
    assert within_goal(predicted, outside)
    # and the free space the allocator could not give back at that OOM is covered by the fit margin
    assert extra["allocator fragmentation"] >= 540.64 * MiB


# --- The terms, from their sources --------------------------------------------------------------

def test_nccl_buffers_from_nccl_defaults():
    assert cal.nccl_buffer_bytes(1) == 0  # one process: no peers, no connections
    per_connection = 4 * MiB + 512 * 1024 + 120 * 640 * 8 * 8  # Simple + LL + LL128 (nccl src/init.cc)
    assert cal.nccl_buffer_bytes(8) == 16 * 4 * per_connection
    assert 0.5 * GiB < cal.nccl_buffer_bytes(8) < 0.7 * GiB


def test_load_path_counts_only_without_zero_init():
    assert cal.load_path_bytes(True, 8_030_261_248, 2) == 0  # zerotune: zero.Init (TrainingArguments first)
    assert cal.load_path_bytes(False, 8_030_261_248, 2) == 16_060_522_496
    extra = cal.overheads(10 * GiB, world=8, gpu_is_cuda=True, zero_init=False, n_params=8_030_261_248)
    assert extra["load without zero.Init"] == 16_060_522_496
    assert cal.views(10 * GiB, extra)["reserved"] >= 16_060_522_496  # nebuly-ai/optimate#242: CA 13.8 GB, MA 1 GB


def test_offload_handoff_from_deepspeed_source():
    # 8B over 4 GPUs: the embedding's partition (525,336,576 / 4) passes through the GPU as an fp32
    # partition, an fp32 copy of the pinned buffer and an fp64 norm temporary: 16 B per element.
    m = shape_of(str(MODELS["8b"]))
    off = {**ZERO3, "offload_optimizer": {"device": "cpu"}}
    assert offload_handoff_bytes(m, off, 4, accum_bytes=4) == 16 * 131_334_144
    assert offload_handoff_bytes(m, off, 4, accum_bytes=2) == 12 * 131_334_144
    assert offload_handoff_bytes(m, ZERO3, 4, accum_bytes=4) == 0  # no offload: grads stay in GPU partitions
    # It raises the peak only by what exceeds the activations and logits it outlives: at 16K tokens (the
    # offload recipe) they dwarf it, at 512 tokens it sets the peak.
    long = memory_breakdown(m, seq=16384, micro=1, precision="fp16", attention="sdpa", liger=True,
                            checkpointing=True, packing=True, zero=off, gpus_per_node=4, nodes=1,
                            grad_accum_bytes=4)
    assert "offload grad hand-off (end of backward)" not in long["parts"]
    short = _issue_config("8b", 4, True)
    assert short["parts"]["offload grad hand-off (end of backward)"] > 0
    assert sum(short["parts"].values()) == short["peak"]


def test_cpu_target_keeps_its_margin_and_has_no_gpu_terms():
    extra = cal.overheads(10 * GiB, world=2, gpu_is_cuda=False)
    assert extra == {"allocator margin (CPU)": int(0.05 * 10 * GiB)}
    assert cal.views(10 * GiB, extra, gpu_is_cuda=False)["nvidia_smi"] == 10 * GiB


# --- Issue 19's held-out set: V100-32GB, HF Trainer + ZeRO-3, fp16, grad ckpt, micro 1, 512 tokens ----
# The issue gives no absolute numbers, only how far the planner at commit 0101713 was below them:
# 1B Llama on 1/2/4/8 GPUs "about 5-20%", 8B with optimizer offload on 4 GPUs "about a third", and the
# 8B 8-GPU prediction "inside its measured range". Read as (measured - predicted) / measured, a
# measurement lies at old / (1 - u). OLD_GIB: that commit's predictions for these configurations.
ZERO3 = json.loads((REPO_ROOT / "configs" / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
MODELS = {"1b": REPO_ROOT / "configs" / "models" / "llama32_1b.json",
          "8b": REPO_ROOT / "configs" / "models" / "llama31_8b.json"}
ISSUE_19 = [  # (model, GPUs, optimizer offload, old prediction GiB, underprediction range)
    ("1b", 1, False, 25.53, (0.05, 0.20)),
    ("1b", 2, False, 14.65, (0.05, 0.20)),
    ("1b", 4, False, 9.21, (0.05, 0.20)),
    ("1b", 8, False, 6.49, (0.05, 0.20)),
]


def _issue_config(model, gpus, offload):
    zero = dict(ZERO3)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return memory_breakdown(shape_of(str(MODELS[model])), seq=512, micro=1, precision="fp16",
                            attention="sdpa", liger=False, checkpointing=True, packing=False, zero=zero,
                            gpus_per_node=gpus, nodes=1, gpu_is_cuda=True, grad_accum_bytes=4)  # zero3.json: fp32


def test_llama32_1b_config_is_the_public_one():
    assert shape_of(str(MODELS["1b"])).n_params == 1_235_814_400  # tied embeddings


@pytest.mark.parametrize("model,gpus,offload,old,under", ISSUE_19)
def test_issue19_1b_rows_can_meet_the_goal(model, gpus, offload, old, under):
    # Measured lies in [old / 0.95, old / 0.80]. The nvidia-smi view must be able to sit within the
    # goal of some point of that range, and must not stay where the old planner was.
    smi = _issue_config(model, gpus, offload)["views"]["nvidia_smi"] / GiB
    lo, hi = old / (1 - under[0]), old / (1 - under[1])
    assert smi >= (1 - FLOOR) * lo and smi <= (1 + TOL) * hi
    assert smi > old * 1.05


def test_issue19_8b_8gpu_stays_in_range():
    m = _issue_config("8b", 8, False)
    # the old 21.78 GiB was inside the measured range: the fit figure must not move far from it, and
    # the nvidia-smi view (the top of what tools report) must not fall below it
    assert m["views"]["nvidia_smi"] / GiB >= 21.78
    assert m["peak"] / GiB <= 21.78 * (1 + TOL)


def test_issue19_8b_offload_4gpu_meets_goal():
    # "about a third" below the old 7.64 GiB: the measurement lies near 7.64 / (1 - 1/3) = 11.46 GiB. Without
    # the end-of-backward offload hand-off (offload_handoff_bytes) the planner reached 10.2 GiB (11% low).
    smi = _issue_config("8b", 4, True)["views"]["nvidia_smi"] / GiB
    assert within_goal(smi, 7.64 / (1 - 1 / 3))


def test_views_order_and_breakdown_sum():
    m = _issue_config("1b", 8, False)
    v = m["views"]
    assert v["allocated"] < m["peak"] < v["nvidia_smi"] and v["allocated"] < v["reserved"] < v["nvidia_smi"]
    assert sum(m["parts"].values()) == m["peak"]
    assert v["nvidia_smi"] - v["reserved"] == cal.CUDA_CONTEXT_BYTES + cal.nccl_buffer_bytes(8)
