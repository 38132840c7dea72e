"""What each accelerator can do, and the precision/attention/Liger choice that follows.

One explicit table, keyed by CUDA compute capability. `auto` picks from it and
says what it picked; an explicit request the hardware cannot honour is an error
that names the alternative. Nothing falls back silently.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from .errors import UserError


class CapabilityError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class GPU:
    name: str
    capability: tuple[int, int] | None  # None = CPU
    peak_tflops: float | None  # dense 16-bit tensor peak, for MFU
    bf16: bool
    flash_attention_2: bool
    # The device's memory as PyTorch reports it: "GPU 0 has a total capacity of X GiB" in its OOM messages,
    # i.e. cudaMemGetInfo's total (torch.cuda.mem_get_info()[1]). Less than the marketing size (ECC, driver
    # reserve) and a little dependent on the driver; everything a process allocates, CUDA context and NCCL
    # buffers included, must fit in it. The only memory figure per GPU: plans and checks use this one.
    usable_gib: float = 0.0
    # The planner's assumed model FLOPs utilisation of the kernels alone (matmuls, attention, Liger) for
    # training: communication, the optimizer step and fixed costs are separate terms (planner/time.py).
    default_mfu: float | None = None
    # The cluster type the planner assumes around this GPU: a key of planner/time.py CLUSTERS, where the
    # link bandwidths (in the node, between nodes, to the host) live with their sources.
    cluster: str | None = None
    # Dense fp32 peak without tensor cores (vendor datasheets), for a family that cannot train in fp16 on a GPU
    # without bf16 (families.py: Gemma 3 on V100/T4 trains in fp32, about 8x fewer FLOPS than fp16 there).
    fp32_tflops: float | None = None


def peak_tflops(gpu: GPU, precision: str) -> float | None:
    """The peak the time model and MFU use for a run in `precision` on this GPU."""
    return gpu.fp32_tflops if precision == "fp32" and gpu.capability is not None else gpu.peak_tflops


# Peak dense 16-bit tensor TFLOPS from vendor datasheets (fp16 on V100/T4, bf16 on A100/H100); fp32 (no TF32:
# PyTorch leaves torch.backends.cuda.matmul.allow_tf32 off) from the same datasheets: V100-SXM2 15.7, T4 8.1,
# A100 19.5, H100-SXM 67.
# usable_gib, from PyTorch OOM messages ("total capacity"), the lowest seen with a recent driver:
#   V100-SXM2-32GB 31.75: measured on a zerotune user's V100 (NOTES, third round); haotian-liu/LLaVA#812
#     shows 31.74 on another driver: 0.01 GiB, inside the planner's fragmentation margin.
#   T4 14.56: Zheng-Chong/CatVTON#133 and AlphaGPU/leetgpu-challenges#52 (2025); 14.57-14.58 on other hosts
#     (QwenLM/Qwen3-VL#1046, mbzuai-oryx/GeoPixel#5, driver 535), 14.75-14.76 with older drivers.
#   A100-SXM4-80GB 79.15: the figure in PyTorch OOM reports from A100-80GB hosts (vLLM and PyTorch users;
#     levihsu/OOTDiffusion#235 shows 79.25 on another A100); not measured here.
#   H100-SXM5-80GB 79.11: vllm-project/vllm#27508 (H100); not measured here.
#   H200-SXM-141GB 139.80: measured on the H200 lent to this repo on 2026-11-26 (torch 2.11 / CUDA 13.0,
#     get_device_properties total_memory 150,109,880,320 bytes; bench/results/gpu_check/h200_2026-11-26.log).
# H200 SXM from NVIDIA's H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e,
#   4.8 TB/s, FP16/BF16 tensor 1,979 TFLOPS with sparsity (989 dense), FP32 67. Same Hopper die as the H100 SXM:
#   the same MFU assumption. Its cluster is DGX H100's (a DGX H200 has the same NVLink4 and 8x NDR); that
#   cluster's HBM figure is the H100's 3.35 TB/s, which only scales the optimizer-step term (planner/time.py).
GPUS = {
    "v100-32gb": GPU("V100-SXM2-32GB", (7, 0), 125.0, bf16=False, flash_attention_2=False, usable_gib=31.75,
                     default_mfu=0.35, cluster="v100-sxm2-1xedr", fp32_tflops=15.7),
    "t4": GPU("T4", (7, 5), 65.0, bf16=False, flash_attention_2=False, usable_gib=14.56, default_mfu=0.30,
              cluster="t4-pcie-1xedr", fp32_tflops=8.1),
    "a100-80gb": GPU("A100-SXM4-80GB", (8, 0), 312.0, bf16=True, flash_attention_2=True, usable_gib=79.15,
                     default_mfu=0.40, cluster="a100-sxm4-8xhdr", fp32_tflops=19.5),
    "h100-80gb": GPU("H100-SXM5-80GB", (9, 0), 989.0, bf16=True, flash_attention_2=True, usable_gib=79.11,
                     default_mfu=0.35, cluster="h100-sxm5-8xndr", fp32_tflops=67.0),
    "h200": GPU("H200-SXM-141GB", (9, 0), 989.0, bf16=True, flash_attention_2=True, usable_gib=139.80,
                default_mfu=0.35, cluster="h100-sxm5-8xndr", fp32_tflops=67.0),
    "cpu": GPU("CPU", None, None, bf16=False, flash_attention_2=False),
}
# llama.cpp on a GPU beside its weights and KV cache: CUDA context + compute buffers (0.3-0.8 GiB measured at
# 8K context on 8B models); the T4 fit in plan and check counts it.
LLAMA_CPP_OVERHEAD_GIB = 0.6


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    return 2 * layers * kv_heads * head_dim * 2  # K and V, f16 (llama.cpp's default cache type)


def llama_cpp_fit(gpu: GPU, weights_bytes: float, kv_per_token: int, n_ctx: int, max_positions: int) -> dict:
    """A GGUF served by llama.cpp on one GPU: its weights, the f16 KV cache at n_ctx and llama.cpp's own overhead
    against what PyTorch reports usable; and the longest context that fits. The plan sizes each GGUF type with
    it, check the GGUF it was given: one rule, so the two cannot disagree."""
    gib = 2 ** 30
    fixed = weights_bytes + LLAMA_CPP_OVERHEAD_GIB * gib
    need = fixed + kv_per_token * n_ctx
    max_ctx = max(0, min(int((gpu.usable_gib * gib - fixed) // kv_per_token), max_positions))
    return {"usable_gib": gpu.usable_gib, "weights_gib": round(weights_bytes / gib, 3),
            "kv_cache_kib_per_token": kv_per_token / 1024, "n_ctx": n_ctx, "needed_gib": round(need / gib, 3),
            "fits": need <= gpu.usable_gib * gib, "max_context_that_fits": max_ctx}


def gpu_for_capability(cap: tuple[int, int] | None, name: str = "") -> GPU:
    if cap is None:
        return GPUS["cpu"]
    for g in GPUS.values():
        if g.capability == cap and (not name or g.name.split("-")[0].lower() in name.lower()):
            return g
    # An unlisted GPU: capabilities follow the architecture, peak is unknown (no MFU).
    return GPU(name or f"sm{cap[0]}{cap[1]}", cap, None, bf16=cap >= (8, 0), flash_attention_2=cap >= (8, 0))


def detect() -> GPU:
    import torch

    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        return gpu_for_capability(cap, torch.cuda.get_device_name(0))
    return GPUS["cpu"]


# torch.cuda.get_arch_list() of torch 2.11.0+cu126 (pytorch #182250): from torch 2.11 only the CUDA 12.6 builds
# carry Volta (sm_70), and Pascal and Maxwell with it (#172352 dropped it from cu128; CUDA 13 dropped it, #157517).
CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")


def runs_on(capability: tuple[int, int], arch_list) -> bool:
    """Whether a torch build whose torch.cuda.get_arch_list() is `arch_list` has code a GPU of `capability` runs:
    sm_XY (SASS) runs on X.Y and on later minors of the same major (sm_80 on an 8.6 card), never on another major;
    compute_XY (PTX) is compiled by the driver for X.Y and anything later. An arch-specific "a" build (sm_90a) runs
    on its own X.Y only (CUDA's compatibility rules; torch.cuda._check_capability applies the same)."""
    major, minor = capability
    for arch in arch_list:
        kind, _, code = arch.partition("_")
        digits = code.rstrip("abcdefghijklmnopqrstuvwxyz")
        if kind not in ("sm", "compute") or not digits.isdigit():
            continue
        x, y = divmod(int(digits), 10)
        if code.endswith("a"):
            ok = (x, y) == (major, minor)
        elif kind == "sm":
            ok = x == major and y <= minor
        else:
            ok = (x, y) <= (major, minor)
        if ok:
            return True
    return False


def require_kernels() -> None:
    """Refuse, in one message, a torch build without code for this machine's GPUs: every CUDA op would fail
    ("no kernel image is available") after minutes of loading. Nothing to check on CPU."""
    import torch

    if not torch.cuda.is_available():
        return
    archs = torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        if runs_on(cap, archs):
            continue
        sm = f"sm_{cap[0]}{cap[1]}"
        fix = (f"install a CUDA 12.6 build, the last that carries {sm}: `make setup TORCH=cu126` (torch 2.11-2.14 "
               "cu126 wheels; CUDA 13 builds dropped Volta, pytorch #157517, and cu128 builds did from 2.11, #172352)"
               if runs_on(cap, CU126_ARCHS) else
               f"install a torch build whose torch.cuda.get_arch_list() covers {sm} (`make setup TORCH=<its CUDA tag>`, "
               "see https://pytorch.org/get-started/locally/)")
        raise CapabilityError(f"GPU {i} ({torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}) has no "
                              f"kernels in this torch {torch.__version__} (CUDA {torch.version.cuda}; built for "
                              f"{', '.join(archs) or 'nothing'}): {fix}.")


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes per element of what a run trains and saves in


def dtype_bytes(precision: str) -> int:
    return PRECISION_BYTES[precision]


@dataclass(frozen=True)
class Choice:
    precision: str  # fp32 | fp16 | bf16
    attention: str  # sdpa_docs | sdpa | eager | flash_attention_2
    liger: bool
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return f"precision {self.precision}, attention {self.attention}, liger {'on' if self.liger else 'off'}"


def choose(gpu: GPU, precision: str = "auto", attention: str = "auto", liger: str = "auto",
           fa2_installed: bool | None = None, family=None) -> Choice:
    """family: a families.Family, whose own precision limits (Gemma 3: no fp16) apply on top of the GPU's."""
    fa2_installed = flash_attn_installed() if fa2_installed is None else fa2_installed
    why = []
    on_gpu = gpu.capability is not None
    no_fp16 = family.precision_refusal("fp16") if on_gpu and family is not None else None

    if precision == "auto":
        precision = "bf16" if gpu.bf16 else ("fp16" if on_gpu and not no_fp16 else "fp32")
        if precision == "fp32" and on_gpu:  # a family that overflows in fp16 on a GPU without bf16 (Gemma 3 on V100)
            why.append(f"precision auto -> fp32 ({gpu.name}: bf16 no; {family.name} is refused in fp16, see "
                       f"docs/training.md#model-families; fp32 peak {gpu.fp32_tflops} TFLOPS, not "
                       f"{gpu.peak_tflops})")
        else:
            why.append(f"precision auto -> {precision} ({gpu.name}: bf16 {'yes' if gpu.bf16 else 'no'})")
    elif precision == "bf16" and not gpu.bf16:
        alt = ("fp32" if no_fp16 else "fp16") if on_gpu else "fp32"
        raise CapabilityError(f"precision bf16 requested but {gpu.name} has no bf16 support. "
                              f"Use train.precision={alt} (or auto).")
    elif precision == "fp16" and not on_gpu:
        raise CapabilityError("precision fp16 requested on CPU: mixed-precision fp16 needs a CUDA GPU. "
                              "Use train.precision=fp32 (or auto).")
    elif precision == "fp16" and no_fp16:
        alt = "bf16 (or auto)" if gpu.bf16 else (f"fp32 (or auto; {gpu.fp32_tflops} instead of {gpu.peak_tflops} "
                                                 "TFLOPS on this GPU), or a GPU with bf16 (A100, H100)")
        raise CapabilityError(f"precision fp16 requested for a {family.name} model, which zerotune does not train in "
                              f"fp16: {no_fp16}. Use train.precision={alt}.")

    if attention == "auto":
        # sdpa_docs (attention.py): packed rows attend within each document with SDPA's causal kernel, no S x S mask
        if gpu.flash_attention_2 and fa2_installed:
            attention = "flash_attention_2"
        else:
            attention = "sdpa_docs"
        reason = ("sm80+ with flash-attn installed" if attention == "flash_attention_2" else
                  f"{gpu.name} has no FlashAttention 2: SDPA per document, memory-efficient kernel" if on_gpu and not gpu.flash_attention_2 else
                  "flash-attn not installed (pip install -e .[flash]): SDPA per document" if gpu.flash_attention_2 else
                  "CPU: SDPA per document")
        why.append(f"attention auto -> {attention} ({reason})")
    elif attention == "flash_attention_2":
        if not gpu.flash_attention_2:
            raise CapabilityError(f"attention flash_attention_2 requested but {gpu.name} "
                                  f"(sm{''.join(map(str, gpu.capability)) if gpu.capability else ' n/a'}) is not supported "
                                  "by FlashAttention 2 (needs sm80+, flash-attention #891). Use train.attention=sdpa_docs (or auto).")
        if not fa2_installed:
            raise CapabilityError("attention flash_attention_2 requested but flash-attn is not installed. "
                                  "Install it with `pip install -e .[flash]` or use train.attention=sdpa_docs (or auto).")

    if liger == "auto":
        use_liger = on_gpu
        why.append(f"liger auto -> {'on' if use_liger else 'off'} ({'Triton kernels on CUDA' if on_gpu else 'Triton needs a GPU'})")
    else:
        use_liger = liger == "on"
        if use_liger and not on_gpu:
            raise CapabilityError("liger on requested on CPU: Liger's Triton kernels need a CUDA GPU "
                                  "(on CPU only the Triton interpreter runs them, for tests). Use train.liger=off (or auto).")
    if use_liger and precision == "fp16" and gpu.capability is not None and gpu.capability < (8, 0):
        # Kept on: at 16K tokens x 128K vocab the unfused loss needs 12 B x vocab x tokens (23.5 GiB) against
        # ~4.2 GiB for the fused one even on its sm<80 fallback path (liger_kernel 0.8.5
        # ops/fused_linear_cross_entropy.py:326-371), whose only other cost is an fp16 lm_head gradient.
        why.append(f"liger below sm80 ({gpu.name}): fused CE accumulates a trainable lm_head's gradient in fp16 via "
                   "a vocab x hidden fp16 + fp32 temporary per chunk (counted by the planner); inf/NaN in it is "
                   "counted per step and stops the run if it persists")
    return Choice(precision, attention, use_liger, tuple(why))
