"""The worker's side of a checkpoint's conversion for another world size (reshard.py, run by the launcher): after
DeepSpeed loaded the conversion, put back what its loader gets wrong and check what it loaded, on every rank, before
the first step."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from ..checkpoint import CommitMarker
from ..reshard import STATES, Conversion, close_enough, moments, procs


class UniversalLoadError(RuntimeError):
    pass


def rescale_loss_scale(scaler, ga_was: int, ga_now: int) -> tuple[float, float] | None:
    """fp16's dynamic loss scale for the new grad-accum: (old, new) scale, or None when nothing changes.

    The universal load restores DeepSpeed's loss scaler as it was (stage3.py:3660 -> :3760-3763): cur_scale,
    cur_iter, last overflow and hysteresis. But each micro-batch's loss, hence its fp16 gradient, is 1/grad-accum
    of the step's (ds_config.py, the Trainer's scaling), so at another grad-accum the scale it grew to is off by
    ga_was/ga_now. Too high (2 -> 4 nodes at 8B: grad-accum 240 -> 120, one power of two): overflows until
    hysteresis is spent and the scale halves, each a skipped step of hours. Too low (4 -> 2 nodes): underflow that,
    with 2-16 steps per epoch and a growth window of 1,000, never recovers. Scaled by the nearest power of two, kept
    at or above min_scale."""
    import math

    if not getattr(scaler, "dynamic", False) or not ga_was or ga_was == ga_now:
        return None
    old = float(scaler.cur_scale)
    new = max(old * 2.0 ** round(math.log2(ga_now / ga_was)), float(scaler.min_scale))
    scaler.cur_scale = new
    return old, new


class CheckUniversalLoad(TrainerCallback):
    """After DeepSpeed loaded the conversion (the Trainer loads it at trainer.py:1801-1810, inside :1615, before
    on_train_begin at :1653): put back what the universal loader gets wrong, and check what it loaded, on every rank.

    - stage3.py:3664, :3681 give every ZeRO-3 sub-group the one step tensor loaded, and Adam increments it in place
      once per sub-group step (torch/optim/adam.py:414, :686, :876): with 2 sub-groups the resumed run's bias
      correction is a step ahead after one step, and it drifts further each step. Each sub-group gets its own.
    - The step stays where it was loaded; torch's own load_state_dict moves it to the parameter's device for a
      fused or capturable optimizer (torch/optim/optimizer.py:794-798). Done here likewise.
    - stage3.py:3685-3691 copies param group 0's hyper-parameters into every group: the Trainer's no-decay group
      (norms, biases) would get group 0's weight decay. Each group gets its own back from the conversion.
    - DeepSpeed #6691 (open): training resumed from a universal ZeRO-3 checkpoint "as if initialized from scratch".
      Each rank sums the squares of its partition of every parameter's fp32 weights, m and v (and the same
      weighted by element index, which catches a partition at the wrong offset); the all-reduced sums must equal
      the conversion's. A mismatch stops the run before its first step, with the original checkpoint intact."""

    def __init__(self, trainer, folder: Path, saved: int):
        self.trainer, self.folder, self.saved = trainer, Path(folder), saved

    def on_train_begin(self, args, state, control, **kw):
        import torch
        import torch.distributed as dist

        marker = Conversion.read(self.folder)
        tag = (self.folder / "latest_universal").read_text().strip()
        saved = torch.load(self.folder / tag / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
        zero = self.trainer.model_wrapped.optimizer  # DeepSpeed's ZeRO-3 optimizer; .optimizer is torch's AdamW
        groups = saved["param_groups"]
        if len(groups) != len(zero.optimizer.param_groups):
            raise UniversalLoadError(f"{self.folder}: {len(groups)} optimizer param groups saved, "
                                     f"{len(zero.optimizer.param_groups)} in this run")
        for group, was in zip(zero.optimizer.param_groups, groups):
            group.update({k: v for k, v in was.items() if k != "params"})
        for sub, flat in enumerate(zero.fp32_partitioned_groups_flat):
            st = zero.optimizer.state.get(flat, {})
            if not isinstance(st.get("step"), torch.Tensor):
                continue
            st["step"] = st["step"].clone()  # one tensor per sub-group, not the one stage3.py:3681 shares
            group = zero.optimizer.param_groups[zero.sub_group_to_group_id[sub]]
            if group.get("fused") or group.get("capturable"):
                st["step"] = st["step"].to(dtype=torch.float32, device=flat.device)

        ga_was = CommitMarker.read(self.folder.parent).grad_accum  # the conversion's checkpoint; None: older
        rescaled = rescale_loss_scale(getattr(zero, "loss_scaler", None), ga_was, args.gradient_accumulation_steps)
        if rescaled and state.is_world_process_zero:
            print(f"finetune: fp16 loss scale {rescaled[0]:g} -> {rescaled[1]:g} for grad-accum {ga_was} -> "
                  f"{args.gradient_accumulation_steps} (each micro-batch's gradient is 1/grad-accum of the step's)",
                  flush=True)

        names = sorted(marker.params)
        local = torch.zeros(len(names), len(STATES), 2, dtype=torch.float64)
        rank = dist.get_rank() if dist.is_initialized() else 0
        for sub, params in enumerate(zero.fp16_groups):
            flat = {"fp32": zero.fp32_partitioned_groups_flat[sub]}
            for s in ("exp_avg", "exp_avg_sq"):
                flat[s] = zero.optimizer.state[flat["fp32"]][s]
            offset = 0
            for p in params:
                part, i = p.ds_tensor.ds_numel, names.index(zero.param_names[p])
                start = rank * part
                valid = max(0, min(part, p.ds_numel - start))  # the last rank's tail is padding
                for j, s in enumerate(STATES):
                    local[i, j] = torch.tensor(moments(flat[s].narrow(0, offset, valid), start), dtype=torch.float64)
                offset += part
        total = local.to(args.device)
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total = total.cpu()
        bad = [f"{n} {s}" for i, n in enumerate(names) for j, s in enumerate(STATES)
               if not all(close_enough(float(total[i, j, k]), marker.params[n][s][k]) for k in (0, 1))]
        if bad:
            raise UniversalLoadError(
                f"DeepSpeed's universal load of {self.folder} does not match the conversion ({len(bad)} of "
                f"{len(names) * len(STATES)} states differ, e.g. {', '.join(bad[:3])}); nothing was trained and "
                f"the original checkpoint is intact: resume with {procs(self.saved)}.")
        if state.is_world_process_zero:
            step = next((v["step"] for v in zero.optimizer.state.values() if "step" in v), None)
            print(f"finetune: universal load checked: fp32 weights, Adam m and v of {len(names)} tensors "
                  f"({sum(p['numel'] for p in marker.params.values()):,} parameters) equal the conversion on "
                  f"{procs(args.world_size)}; Adam step {int(step) if step is not None else '?'}, "
                  f"lr {zero.optimizer.param_groups[0]['lr']:.3g}", flush=True)
        return control
