"""The whole model gathered once for a generate() call under ZeRO-3, where every rank has room for it: the samples
during training (train/validation.py) and GRPO's rollouts (rl/rollout.py) generate through it."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from . import faults
from .layout import layout
from .planner.records import Phase, Plan


@contextlib.contextmanager
def whole_model(engine, device, phase: Phase):
    """Generate with every parameter gathered once, not once per new token: under ZeRO-3 each forward of generate()
    gathers the whole model again (at 8B, 16 GB per token; across nodes ~1.6 s a token, planner/time.py
    phase_times). DeepSpeed's own unwrap_model_for_generation (deepspeed 0.19.8 runtime/zero/stage3.py:94-123, as
    TRL's of the same name) gathers the parameters on every rank, takes ZeRO-3's module hooks off so no forward
    releases them, and puts them back after (re-registering invalidates the trace, parameter_offload.py:337-343).
    Only where every rank has room for the whole 16-bit model and generate()'s own terms, as the launch's plan
    counts them for this phase (phase: the plan's samples or rollout phase; room_to_gather); else per-token
    gathers, and the context yields False."""
    from deepspeed.runtime.zero import unwrap_model_for_generation

    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None or not room_to_gather(offload.module, device, phase):
        yield False
        return
    with unwrap_model_for_generation(engine):
        yield True


def planned(r, name: str) -> Phase:
    """The launch's plan of a phase that generates ("samples" or "rollout"; layout.run_plan, written before the
    workers start): its generate() terms and the rule decide the gather at run time as in the plan."""
    plan = Plan.read(layout(r).run_plan)
    phase = getattr(plan.phases, name, None) if plan is not None else None
    if phase is None:
        raise RuntimeError(f"{layout(r).run_plan} has no {name} phase: workers start from train/launch.py, which "
                           "writes the launch's plan first")
    return phase


def room_to_gather(module, device, phase: Phase) -> bool:
    """Whether every rank can hold the whole model in its 16-bit dtype beside what it holds now, by the plan's rule
    (Phase.room_to_gather_once: the model plus the phase's generate() terms). The free memory is measured: a GPU's,
    or the host's available RAM shared by this node's ranks; the minimum over ranks decides (the gather is a
    collective: all or none)."""
    whole = sum(p.ds_numel * p.ds_tensor.element_size() for p in module.parameters())
    if torch.cuda.is_available():
        # the driver's free memory does not count what PyTorch's allocator holds cached from the training step (at
        # a 16K step, most of the card): hand it back first, as the gather would reuse it anyway
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = _available_ram() / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    room = not faults.no_room_to_gather() and phase.room_to_gather_once(int(free), whole)
    ok = torch.tensor(1.0 if room else 0.0, device=device)
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _available_ram() -> float:
    """The host's MemAvailable (Linux /proc/meminfo), in bytes; 0 where unknown (then nothing is gathered)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0.0
