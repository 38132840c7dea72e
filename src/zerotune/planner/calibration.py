"""What a GPU holds beyond the tensors memory.py counts: the gap between the planner's tensors,
`torch.cuda.max_memory_allocated`, `max_memory_reserved` and what nvidia-smi shows.

Three views, each one a named sum (memory_breakdown reports all three; "fits" uses the last):
  allocated   = every tensor memory.py counts (what max_memory_allocated measures)
  reserved    = allocated + the caching allocator's cached-but-free blocks (max_memory_reserved)
  nvidia-smi  = reserved + memory outside PyTorch's allocator (CUDA context, NCCL buffers)

Terms examined and shown not to add GPU memory in zerotune's setup are kept here as functions that
return 0 with the upstream line that shows it, so a change of setup makes them count again.
"""

from __future__ import annotations

GiB = 1024 ** 3
MiB = 1024 ** 2

# NCCL's per-connection FIFOs, allocated with cudaMalloc outside PyTorch's allocator.
# nccl src/init.cc: DEFAULT_BUFFSIZE (1 << 22) = 4 MiB (Simple protocol);
# DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS 8 x 16 B;
# DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x NCCL_STEPS 8 x 8 B.
NCCL_SIMPLE_BYTES = 1 << 22
NCCL_LL_BYTES = 8 * 512 * 8 * 16
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
# nccl#986 (sjeaugey): "Ring uses a limited amount of memory as it only has 2 connections regardless
# of the scale"; memory "is linearly tied to the number of channels". Ring (prev, next) + tree (parent,
# child) = 4 connections per channel. 16 channels: an assumption for NVLink V100 (NCCL picks 2-32 by
# topology; NCCL_MAX_NCHANNELS caps it). nccl#864 measured ~1.6 GB for one communicator after an
# all-reduce on a newer GPU: the same order as this term, which is why it is counted at all.
NCCL_CHANNELS = 16
NCCL_CONNECTIONS_PER_CHANNEL = 4

# The caching allocator keeps freed blocks: ZeRO-3 gathers and frees every layer's parameters twice
# a step (forward, recompute/backward) in sizes that differ by layer, so peak reserved > peak allocated.
# Published peak reserved / peak allocated ratios with sharded parameters:
#   DeepSpeed see_memory_usage (Max_CA / Max_MA): deepspeedai/DeepSpeed#522 6.39/5.09 = 1.26 and
#   6.68/5.31 = 1.26; NiuTrans/Vision-LLM-Alignment#9 (ZeRO-3) 15.42/12.26 = 1.26
#   meta-llama/llama-cookbook PR #41 (4xA100-40GB FSDP, Llama-2-7B): 32.67/25.86 = 1.26, 27.36/20.20
#   = 1.35, 19.36/15.22 = 1.27; PR #165 (8 GPUs FSDP, Llama-2-7B): 19.52/14.93 = 1.31
# 1.29 is within 10% of every one of these ratios and at most 5% below the largest (1.35): the goal
# issue 19 sets for the planner, applied to the ratio. It sets the reserved and nvidia-smi views.
RESERVE_FRACTION = 0.29
# Whether a run fits is a different question: before raising OOM, PyTorch's allocator frees every
# cached block that holds no live tensor and retries (c10/cuda/CUDACachingAllocator.cpp,
# DeviceCachingAllocator::malloc: "Free all non-split cached blocks and retry alloc."), so only the
# free space inside segments that still hold live tensors is lost. At an actual OOM on a V100-16GB
# (meta-llama/llama-cookbook#234, 8 ranks, FSDP): "13.76 GiB is allocated by PyTorch, and 540.64 MiB
# is reserved by PyTorch but unallocated" = 3.9% of allocated. 5% covers it.
LIVE_FRAGMENTATION = 0.05
# CUDA context + kernel images + cuBLAS handle, as nvidia-smi sees it (outside the allocator).
# pytorch#107667 (ptrblck, 2023): ~300 MB since CUDA 11.7 lazy module loading (>1000 MB before it);
# pytorch#20532: 300-400 MB per process on a p3.8xlarge (V100); pytorch#28113: 200-700 MB by machine.
# cuBLAS workspaces (:4096:2:16:8 = 8.1 MiB per handle/stream below sm90, PyTorch "CUDA semantics"
# docs, pytorch PR #100919) are allocated through the caching allocator and so sit in `reserved`.
#
# Same OOM report: "this process has 15.76 GiB memory in use" - 13.76 allocated - 0.53 reserved-free
# = 1.47 GiB outside PyTorch's allocator on a V100 with 8 NCCL ranks. Less NCCL's 0.57 GiB below, the
# CUDA context + kernel images + cuBLAS handle come to ~0.9 GiB there (CUDA 12, eager module loading
# on sm70 wheels is not assumed away).
CUDA_CONTEXT_BYTES = int(0.9 * GiB)
# CPU targets (gloo, glibc malloc): no caching allocator; keep the small margin memory.py always had.
CPU_MARGIN_FRACTION = 0.05


def nccl_buffer_bytes(world: int) -> int:
    """NCCL FIFOs per rank for the default communicator; a single process opens no connections."""
    if world <= 1:
        return 0
    per_connection = NCCL_SIMPLE_BYTES + NCCL_LL_BYTES + NCCL_LL128_BYTES
    return NCCL_CHANNELS * NCCL_CONNECTIONS_PER_CHANNEL * per_connection


def load_path_bytes(zero_init: bool, n_params: int, dtype_bytes: int) -> int:
    """GPU bytes of loading the model outside deepspeed.zero.Init.

    zerotune creates TrainingArguments(deepspeed=...) before from_pretrained (train/worker.py), so
    transformers 5.23 modeling_utils.py:1435 (`needs_zero3_init = is_deepspeed_zero3_enabled() ...`)
    wraps construction in zero.Init and integrations/deepspeed.py:522 loads each module under
    GatheredParameters (one module gathered at a time: the estimator's 4 B x largest layer).
    Without zero.Init the full 16-bit model passes through each GPU before DeepSpeed partitions it and
    stays cached: nebuly-ai/optimate#242 (LLaMA-7B, ZeRO-3) logs MA 1.0 GB, CA 13.8 GB after init,
    i.e. ~7B x 2 B reserved with almost nothing allocated.
    """
    return 0 if zero_init else n_params * dtype_bytes


def overheads(allocated: int, *, world: int, gpu_is_cuda: bool, zero_init: bool = True,
              n_params: int = 0, dtype_bytes: int = 2) -> dict:
    """{term: bytes} that must fit beside the planner's tensors (memory_breakdown adds them to its parts)."""
    if not gpu_is_cuda:
        return {"allocator margin (CPU)": int(CPU_MARGIN_FRACTION * allocated)}
    out = {"allocator fragmentation": int(LIVE_FRAGMENTATION * allocated)}
    load = load_path_bytes(zero_init, n_params, dtype_bytes)
    if load:
        out["load without zero.Init"] = load
    out["CUDA context (outside allocator)"] = CUDA_CONTEXT_BYTES
    nccl = nccl_buffer_bytes(world)
    if nccl:
        out["NCCL buffers (outside allocator)"] = nccl
    return out


def views(allocated: int, extra: dict, gpu_is_cuda: bool = True) -> dict:
    """Peak bytes as each tool reports them: max_memory_allocated, max_memory_reserved, nvidia-smi.

    reserved counts the cache the allocator keeps while nothing presses on it (RESERVE_FRACTION); under
    pressure it gives that back, which is why "fits" uses allocated + overheads() instead.
    """
    outside = sum(v for k, v in extra.items() if "outside allocator" in k)
    load = extra.get("load without zero.Init", 0)
    if not gpu_is_cuda:
        return {"allocated": allocated, "reserved": allocated, "nvidia_smi": allocated}
    reserved = max(int((1 + RESERVE_FRACTION) * allocated), load)
    return {"allocated": allocated, "reserved": reserved, "nvidia_smi": reserved + outside}
