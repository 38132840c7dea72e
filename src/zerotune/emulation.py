"""Run on one CUDA card as another would: a V100's choices, kernels and memory on a borrowed H100/H200.

scripts/gpu_check.py (`make gpu-check`, --as v100-32gb) runs every row inside `emulate(emulation_for(...))`:

- zerotune's own choice for the target (hardware.choose for hardware.GPUS[target]: fp16 with DeepSpeed's loss
  scaler, sdpa_docs, Liger on, no FlashAttention 2) - the caller passes `Emulation.gpu` wherever the worker would
  pass hardware.detect();
- SDPA limited to the backends the target has (sm70/sm75: the memory-efficient kernel; flash and cuDNN SDPA need
  sm80+), through torch.nn.attention.sdpa_kernel. A call none of them takes raises "No available kernel" on CUDA
  ("No viable backend" on CPU); attention.SdpaGuard records which call and reruns it on the math kernel, as the
  target would run it, so the caller can report it as a failure and still measure;
- the caching allocator capped (torch.cuda.set_per_process_memory_fraction) at what the target leaves it: its
  usable memory (hardware.GPU.usable_gib, PyTorch's "total capacity") less the CUDA context the planner assumes
  outside the allocator (planner/calibration.py CUDA_CONTEXT_BYTES), so an out-of-memory is the target's;
- torch.cuda.get_device_capability answering the target's capability (and is_bf16_supported its bf16), so code
  that branches on it in Python takes the target's branch: Liger's fused linear cross entropy accumulates the
  lm_head gradient through addmm only from sm80 (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py:326-330 and
  :348-352, else the fp32-temporary fallback at :367-371), liger_kernel/utils.py:95-97 names the architecture
  from it (lru-cached at :124, cleared here), DeepSpeed's accelerator answers is_triton_supported and
  is_fp16_supported from it (accelerator/cuda_accelerator.py:215, :267). A JIT build would then target the
  wrong architecture (deepspeed op_builder/builder.py:684-702 reads TORCH_CUDA_ARCH_LIST first): it is set to
  the real card's.

What no emulation changes: the kernels are compiled for the real card (Triton, cuBLAS, SDPA), its speed, memory
bandwidth and SM count. `Emulation.not_emulated` says so in the report.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from . import hardware
from .attention import SdpaGuard
from .planner import calibration

GiB = 1024 ** 3
TARGETS = tuple(k for k, g in hardware.GPUS.items() if g.capability and g.capability < (8, 0))  # v100-32gb, t4


class EmulationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Emulation:
    target: str  # a hardware.GPUS key, or "native"
    gpu_key: str  # what hardware.choose decides for, and the plan's GPU
    capability: tuple[int, int] | None  # what torch.cuda.get_device_capability answers inside emulate()
    allocator_bytes: int | None  # the allocator's cap; None: the card's own
    fraction: float | None  # ... as set_per_process_memory_fraction's argument
    sdpa: tuple[str, ...]  # SDPBackend names allowed; (): torch chooses
    arch: str | None  # TORCH_CUDA_ARCH_LIST while the capability is patched: the real card's
    emulated: tuple[str, ...]
    not_emulated: tuple[str, ...]

    @property
    def gpu(self) -> hardware.GPU:
        return hardware.GPUS[self.gpu_key]


def card_key(capability, name: str = "") -> str | None:
    """The hardware.GPUS entry of a card (by name and capability), or None for one the table lacks."""
    if capability is None:
        return "cpu"
    g = hardware.gpu_for_capability(tuple(capability), name)
    return next((k for k, known in hardware.GPUS.items() if known == g), None)


def emulation_for(target: str, capability, total: int, name: str = "") -> Emulation:
    """The settings that make a card (compute capability, total bytes as PyTorch reports them) run as `target`."""
    cap = tuple(capability) if capability is not None else None
    own = card_key(cap, name)
    if target == "native":  # an unlisted card plans as the entry whose precision it shares
        key = own or ("a100-80gb" if cap and cap >= (8, 0) else "v100-32gb")
        return Emulation("native", key, cap, None, None, (), None, (),
                         (f"nothing: every row runs as this card runs it (planned as {key})",))
    if target not in TARGETS:
        raise EmulationError(f"--as {target}: only cards below sm80 can be emulated ({', '.join(TARGETS)})")
    g = hardware.GPUS[target]
    usable = int(g.usable_gib * GiB)
    same = cap == g.capability  # the card is the target: only the SDPA restriction (to see a math fallback)
    if cap is None or (not same and total < usable):
        raise EmulationError(f"this card ({name or 'no GPU'}, {total / GiB:.2f} GiB) is smaller than a {g.name} "
                             f"({g.usable_gib} GiB usable): its out-of-memory errors would not be the {target}'s; "
                             "use --as native")
    allocator = None if same else usable - calibration.CUDA_CONTEXT_BYTES
    fraction = None if same else allocator / total
    real = hardware.GPUS.get(own) if own else None
    emulated = (
        f"precision, attention, Liger: hardware.choose for {target} (fp16 with DeepSpeed's loss scaler, sdpa_docs, "
        "no FlashAttention 2)",
        "SDPA: EFFICIENT_ATTENTION only; a call it cannot take is a FAIL naming the call (then run on the math "
        "kernel, as the card would)",
        "memory: the card's own" if same else
        (f"memory: allocator capped at {allocator / GiB:.2f} GiB ({g.usable_gib} usable - "
         f"{calibration.CUDA_CONTEXT_BYTES / GiB:.1f} CUDA context) = {fraction:.4f} of {total / GiB:.2f}"),
        "capability: the card's own" if same else
        (f"capability: torch.cuda.get_device_capability -> {g.capability} (Liger's below-sm80 fused cross "
         "entropy, DeepSpeed's accelerator), bf16 unsupported"),
    )
    not_emulated = (
        f"the {target}'s kernels: Triton, cuBLAS and SDPA run as compiled for sm{cap[0]}{cap[1]}",
        f"speed: {real.peak_tflops if real else '?'} vs {g.peak_tflops} dense fp16 TFLOPS and the memory bandwidth "
        "(times are this card's; the plan's compute term is shown for both)",
        "SM count, the target's own CUDA context size, NVLink/NCCL (world size 1)",
    )
    return Emulation(target, target, g.capability, allocator, fraction, ("EFFICIENT_ATTENTION",),
                     None if same else f"{cap[0]}.{cap[1]}", emulated, not_emulated)


def this_card(target: str) -> Emulation:
    """emulation_for this process's CUDA device 0 (no GPU: native)."""
    import torch

    if not torch.cuda.is_available():
        return emulation_for("native", None, 0)
    props = torch.cuda.get_device_properties(0)
    return emulation_for(target, torch.cuda.get_device_capability(0), props.total_memory, props.name)


@contextlib.contextmanager
def emulate(e: Emulation):
    """Apply `e` in this process (capability, allocator cap, SDPA backends); yields the SdpaGuard. Restores on exit."""
    import torch

    saved = {}
    cuda = torch.cuda.is_available()
    real = torch.cuda.get_device_capability(0) if cuda else None
    if e.target != "native" and e.capability != real:
        saved = {"get_device_capability": torch.cuda.get_device_capability,
                 "is_bf16_supported": torch.cuda.is_bf16_supported}
        torch.cuda.get_device_capability = lambda device=None: tuple(e.capability)
        torch.cuda.is_bf16_supported = lambda including_emulation=True: bool(e.gpu.bf16)
        _clear_liger_arch()
        if e.arch:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", e.arch)
    if e.fraction and cuda:
        torch.cuda.set_per_process_memory_fraction(e.fraction, 0)
    try:
        with SdpaGuard(e.sdpa) as guard:
            yield guard
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        if saved:
            _clear_liger_arch()
        if e.fraction and cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)


def _clear_liger_arch() -> None:
    try:
        from liger_kernel.utils import infer_device_arch
    except ImportError:
        return
    infer_device_arch.cache_clear()
