"""What stops a run because training went wrong, in the order a step meets it. A run that stops on a signal or
its deadline (SIGUSR1, SIGTERM, $ZEROTUNE_DEADLINE: requeued, nothing went wrong) is stopping.py's, acted on by
train/callbacks.py's StopOnSignal.

  when             what went wrong                                           policy              error
  backward         lm_head's gradient inf/NaN before loss scaling (fp16+Liger) LmHeadOverflow      FP16OverflowError
  optimizer.step   DeepSpeed's scaler gives up at its minimum scale            scaler_gave_up      FP16OverflowError
  step end         fp16 overflow persisting at the minimum loss scale          OverflowAtMinScale  FP16OverflowError
  log              a non-finite loss                                           check_loss          NonFiniteLossError
  save             non-finite weights in the checkpoint just written           check_weights       NonFiniteWeightsError

SafetyChecks runs the first, third and fourth as a Trainer callback that the worker puts before StepMetrics, so
a step or a loss that stops the run is judged before it is logged (metrics.jsonl never holds it). The worker
says scaler_gave_up's error when trainer.train raises; CommitCheckpoints.on_save calls check_weights.

Under ZeRO-3 every rank must stop at the same step: a rank that stopped alone would leave the others waiting
in a collective. So each policy decides from what is the same on every rank: counts summed over ranks, the
loss the Trainer gathered, DeepSpeed's scaler state (its overflow flag is a MAX over ranks: deepspeed 0.19.8
runtime/zero/stage3.py:3027), a flag reduced over ranks. Each stops with the last committed checkpoint intact:
nothing here commits.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from .metrics import deepspeed_engine, fp16_scaler, over_ranks


class FP16OverflowError(RuntimeError):
    pass


class NonFiniteLossError(RuntimeError):
    pass


class NonFiniteWeightsError(RuntimeError):
    pass


class SafetyChecks(TrainerCallback):
    """The per-step policies as one callback: put it before StepMetrics in the Trainer's callbacks. attach()
    gives it the Trainer (DeepSpeed's engine); watch_lm_head() adds the lm_head check (fp16 with Liger);
    detach() after training removes its hooks and forgets the Trainer (a hook on a parameter that C++ keeps
    alive would otherwise hold the Trainer and the trained model, issue 19)."""

    def __init__(self, max_overflows_at_min_scale: int = 5):
        self.lm_head = LmHeadOverflow(steps=min(2, max_overflows_at_min_scale))
        self.at_min_scale = OverflowAtMinScale(steps=max_overflows_at_min_scale)
        self.trainer = None
        self.found: dict = {}  # this step's lm_head counts: StepMetrics puts them in the step's row
        self._hooks: list = []

    def attach(self, trainer) -> None:
        self.trainer = trainer

    def watch_lm_head(self, model) -> None:
        self._hooks += self.lm_head.watch(model)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.trainer = None

    def on_step_end(self, args, state, control, **kw):
        if self.lm_head.watching:
            self.found = self.lm_head.step_counts(args.device)  # summed over ranks: every rank decides alike
            self.lm_head.check(self.found["lm_head_grad_nonfinite_unscaled"], state.global_step)
        eng = deepspeed_engine(self.trainer)
        self.at_min_scale.check(fp16_scaler(eng) if eng is not None and args.fp16 else None, state.global_step)

    def on_log(self, args, state, control, logs=None, **kw):
        check_loss((logs or {}).get("loss"), state.global_step)  # the Trainer gathered it: the same on every rank


# ------------------------------------------------------------------------------ backward: lm_head, fp16 + Liger

class LmHeadOverflow:
    """lm_head's gradient inf/NaN before loss scaling, which no loss scale can cure (fp16 with Liger).

    Liger's fused cross entropy builds lm_head's gradient in forward, before loss scaling, in the 16-bit weight
    dtype (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py:116 `torch.zeros_like(weight)`, :375 `+=` per
    chunk below sm80), saves it for backward (:574-578), and multiplies it there by the upstream gradient,
    which carries the loss scale (:438-450). So the gradient autograd hands on (a tensor hook) can be inf from
    ordinary loss-scale overflow, which DeepSpeed's scaler cures by skipping the step and halving the scale
    (deepspeed/runtime/fp16/loss_scaler.py:256-274, hysteresis 2); the gradient Liger saved (found in the
    loss's graph by a forward hook) being non-finite is an overflow lowering the scale cannot cure. Both are
    counted per micro-batch (metrics.jsonl: lm_head_grad_nonfinite, lm_head_grad_nonfinite_unscaled); the run
    stops on the second only, after `steps` steps in a row, because each skipped step costs hours at 8B."""

    def __init__(self, steps: int):
        self.steps = steps
        self.in_a_row = 0
        self.watching = False
        self._scaled = self._unscaled = None  # micro-batches with a non-finite gradient, this step, this rank

    def watch(self, model) -> list:
        """Hook lm_head's gradient and the model's output; returns the hook handles. Nothing when lm_head is
        frozen (LoRA): its gradient is never computed."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None or not head.weight.requires_grad:
            return []

        def scaled_hook(g):
            bad = non_finite(g)
            self._scaled = bad if self._scaled is None else self._scaled + bad
            return g

        def unscaled_hook(module, args, output):
            g = liger_saved_head_grad(output) if module.training else None
            if g is not None:
                bad = non_finite(g)
                self._unscaled = bad if self._unscaled is None else self._unscaled + bad

        self.watching = True
        return [head.weight.register_hook(scaled_hook), model.register_forward_hook(unscaled_hook)]

    def step_counts(self, device) -> dict:
        """This step's counts summed over ranks (the same on every rank); starts the next step's."""
        scaled, unscaled = over_ranks([self._scaled if self._scaled is not None else 0,
                                       self._unscaled if self._unscaled is not None else 0], "sum", device)
        self._scaled = self._unscaled = None
        return {"lm_head_grad_nonfinite": int(scaled), "lm_head_grad_nonfinite_unscaled": int(unscaled)}

    def check(self, unscaled: int, step: int) -> None:
        self.in_a_row = self.in_a_row + 1 if unscaled else 0
        if self.in_a_row >= self.steps:
            raise FP16OverflowError(
                f"lm_head's gradient was inf/NaN before loss scaling in {self.in_a_row} steps in a row "
                f"(step {step}): Liger's fused cross entropy sums it in fp16 in forward, so DeepSpeed lowering the "
                "scale cannot fix it. Use train.liger=off with a shorter data.seq_len (`zerotune plan` shows what "
                "fits), or bf16 on sm80+ GPUs. The last committed checkpoint is intact.")


def non_finite(g: torch.Tensor) -> torch.Tensor:
    """1 if `g` holds an inf or NaN, as a tensor (no sync). Through its extremes: isfinite(g) of the vocab x hidden
    lm_head gradient would allocate 2 bytes per element (about 1 GiB at 8B); amax/amin propagate NaN and inf."""
    return (~torch.isfinite(torch.stack([g.amax(), g.amin()]))).any().int()


def liger_saved_head_grad(output) -> torch.Tensor | None:
    """The lm_head gradient Liger's fused linear cross entropy computed in forward and saved for backward
    (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py:574-578, saved_tensors = (grad_input, grad_weight,
    grad_bias)), found a few nodes up the model loss's graph; None without Liger or without a loss."""
    todo = [(getattr(getattr(output, "loss", None), "grad_fn", None), 0)]
    while todo:
        fn, depth = todo.pop()
        if fn is None or depth > 4:  # the loss is Liger's output, divided or scaled at most a few times
            continue
        if type(fn).__name__.startswith("LigerFusedLinearCrossEntropyFunction"):
            saved = fn.saved_tensors
            return saved[1] if len(saved) > 1 else None
        todo += [(f, depth + 1) for f, _ in fn.next_functions]
    return None


# ------------------------------------------------------------------------------ optimizer.step: DeepSpeed's scaler

def scaler_gave_up(exc: BaseException) -> FP16OverflowError | None:
    """DeepSpeed's dynamic loss scaler raises a plain Exception on an overflow at the minimum scale once its
    hysteresis is spent (deepspeed 0.19.8 runtime/fp16/loss_scaler.py:256-259; raise_error_at_min_scale is not
    configurable, precision_config.py:202-209), inside optimizer.step, before any callback sees the step: the
    run's own at-minimum count (OverflowAtMinScale) never gets there. Said in zerotune's words, or None for any
    other exception. The worker raises it from the one trainer.train raised."""
    if "loss scale already at minimum" not in str(exc):
        return None
    return FP16OverflowError(
        "fp16 gradients overflowed again at DeepSpeed's minimum loss scale (fp16.min_loss_scale): training has "
        "diverged, and a smaller scale is not allowed. metrics.jsonl shows the loss scale falling and, with Liger, "
        "whether lm_head's gradient was inf/NaN before loss scaling (lm_head_grad_nonfinite_unscaled). Lower "
        "train.lr, check the data for extreme samples, or use bf16 on sm80+ GPUs. The last committed checkpoint "
        "is intact.")


# ------------------------------------------------------------------------------ step end: the loss scale

class OverflowAtMinScale:
    """fp16 gradients that keep overflowing at the minimum loss scale: training has diverged. An overflow above
    the minimum is what loss scaling is for (DeepSpeed skips the step and lowers the scale); at the minimum
    nothing is left to lower. DeepSpeed's own scaler raises there first (scaler_gave_up); this count, `steps`
    in a row, is for a scaler that does not."""

    def __init__(self, steps: int):
        self.steps = steps
        self.in_a_row = 0

    def check(self, scaler: dict | None, step: int) -> None:
        """scaler: metrics.fp16_scaler of DeepSpeed's engine after this step; None without one."""
        at_min = scaler is not None and scaler["overflow"] and scaler["loss_scale"] <= scaler["min_loss_scale"]
        self.in_a_row = self.in_a_row + 1 if at_min else 0
        if self.in_a_row >= self.steps:
            raise FP16OverflowError(
                f"fp16 gradients overflowed {self.in_a_row} steps in a row at the minimum loss scale "
                f"{scaler['min_loss_scale']:g} (step {step}): training has diverged. Lower train.lr, check the data "
                "for extreme samples, or use bf16 on sm80+ GPUs. The last committed checkpoint is intact.")


# ------------------------------------------------------------------------------ log: the loss

def check_loss(loss: float | None, step: int) -> None:
    """A NaN/inf loss stops the run before its step reaches a checkpoint. DeepSpeed 0.19 skips a step whose
    gradient norm is non-finite, in every precision, so the weights stay finite and nothing else would stop it
    (train/args.py sets logging_nan_inf_filter=False: the HF Trainer would otherwise average it away)."""
    if loss is not None and not math.isfinite(loss):
        raise NonFiniteLossError(f"loss is {loss} at step {step}: stopping before it reaches a checkpoint. "
                                 "Check the data (a sequence with no label tokens gives 0/0) and the learning rate.")


# ------------------------------------------------------------------------------ save: the weights

def local_weights_finite(model) -> bool:
    """This rank's weights are finite: under ZeRO-3 each rank checks its own partition (ds_tensor)."""
    for p in model.parameters():
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        if t.numel() and not bool(torch.isfinite(t).all()):
            return False
    return True


def check_weights(finite_on_all_ranks: bool, ckpt, step: int, kept: str) -> None:
    """A checkpoint whose weights hold NaN/inf (a diverged or corrupted update) is never committed: resuming
    from it would go on from garbage. CommitCheckpoints.on_save reduces local_weights_finite over ranks and
    calls this on every rank; `kept` says what the user still has (the last committed checkpoint)."""
    if not finite_on_all_ranks:
        raise NonFiniteWeightsError(f"{ckpt} holds non-finite (NaN/inf) weights at step {step}: "
                                    f"not committing it; {kept}. Lower train.lr or check the data.")
