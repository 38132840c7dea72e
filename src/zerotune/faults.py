"""Fault injection for the reliability tests: a real run with one induced fault.

Enabled only by environment variables that the tests set; inert otherwise.
- ZEROTUNE_FAULT_NAN_LOSS_STEP=N: the loss of optimizer step N is NaN (as a 0/0 sample or an fp16 overflow
  would make it). DeepSpeed 0.19 skips a step whose gradient norm is not finite, in every precision, so the
  weights stay finite; the run must still stop and say so.
- ZEROTUNE_FAULT_NAN_WEIGHT_STEP=N: after the update of optimizer step N (before its save), rank 0's first
  weight shard gets a NaN (a diverged or corrupted update), which the commit check must refuse.
- ZEROTUNE_FAULT_EVAL_OOM_STEP=N: the validation of step N runs out of memory, as a 16K eval forward that
  materialises the logits does on a V100: the step must already be committed.
- ZEROTUNE_FAULT_NO_ROOM_TO_GATHER=1: the in-training samples find no room to gather the whole model (as one 8xV100
  node at 8B), so generate() gathers per token under ZeRO-3 (gathering.py whole_model).
- ZEROTUNE_FAULT_KILL_WHILE_CONVERTING=1: the launcher is killed (SIGKILL, as a node failure or scancel's
  second signal would) while it converts a checkpoint to another world size, after DeepSpeed has written the
  conversion and before it is checked and published: the original must be intact and the next attempt resume.
- ZEROTUNE_FAULT_SLOW_CONVERSION=S: at the same point the conversion waits S seconds, as an 8B one takes ~27 min,
  so that a test can send the time-limit warning (USR1) while it converts: it must stop at once, clean.
- ZEROTUNE_FAULT_SLOW_SAMPLES=S: every in-training validation's samples take S seconds more, as 8B generation
  across nodes takes minutes: the deadline must reserve them at the last step (train/callbacks.py StopOnSignal).
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

ENV_NAN_LOSS = "ZEROTUNE_FAULT_NAN_LOSS_STEP"
ENV_NAN_WEIGHT = "ZEROTUNE_FAULT_NAN_WEIGHT_STEP"
ENV_EVAL_OOM = "ZEROTUNE_FAULT_EVAL_OOM_STEP"
ENV_KILL_CONVERTING = "ZEROTUNE_FAULT_KILL_WHILE_CONVERTING"
ENV_NO_ROOM_TO_GATHER = "ZEROTUNE_FAULT_NO_ROOM_TO_GATHER"
ENV_SLOW_CONVERSION = "ZEROTUNE_FAULT_SLOW_CONVERSION"
ENV_SLOW_SAMPLES = "ZEROTUNE_FAULT_SLOW_SAMPLES"


def no_room_to_gather() -> bool:
    return os.environ.get(ENV_NO_ROOM_TO_GATHER) == "1"


def eval_out_of_memory(step: int) -> None:
    """Called by the validation of `step`; raises as the CUDA caching allocator does when asked to."""
    if os.environ.get(ENV_EVAL_OOM) == str(step):
        import torch

        raise torch.OutOfMemoryError(f"faults: {ENV_EVAL_OOM}={step}: CUDA out of memory (injected)")


def kill_while_converting() -> None:
    """Called by reshard.build_conversion between DeepSpeed's conversion and zerotune's checks and publish."""
    if os.environ.get(ENV_KILL_CONVERTING):
        import signal

        print(f"faults: {ENV_KILL_CONVERTING}: killing this process while it converts", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_conversion() -> None:
    """Called by reshard.build_conversion at the same point as kill_while_converting, inside its stoppable block."""
    seconds = os.environ.get(ENV_SLOW_CONVERSION)
    if seconds:
        import time

        print(f"faults: {ENV_SLOW_CONVERSION}={seconds}: the conversion waits {seconds} s", flush=True)
        time.sleep(float(seconds))


def slow_samples() -> None:
    """Called by the in-training validation after its samples, on every rank."""
    seconds = os.environ.get(ENV_SLOW_SAMPLES)
    if seconds:
        import time

        time.sleep(float(seconds))


class NaNLossAt(TrainerCallback):
    def __init__(self, model, step: int):
        self.step, self.current = step, 0
        model.register_forward_hook(self._hook)

    def on_step_begin(self, args, state, control, **kw):
        self.current = state.global_step + 1

    def _hook(self, module, inputs, output):
        if module.training and self.current == self.step and getattr(output, "loss", None) is not None:
            output.loss = output.loss * float("nan")
        return output


class NaNWeightAfter(TrainerCallback):
    def __init__(self, model, step: int):
        self.model, self.step = model, step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step and state.is_world_process_zero:
            p = next(self.model.parameters())
            (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).view(-1)[0] = float("nan")


def callbacks(model) -> list:
    out = []
    for env, cls in ((ENV_NAN_LOSS, NaNLossAt), (ENV_NAN_WEIGHT, NaNWeightAfter)):
        if os.environ.get(env):
            print(f"faults: {env}={os.environ[env]}: injecting a NaN", flush=True)
            out.append(cls(model, int(os.environ[env])))
    return out
