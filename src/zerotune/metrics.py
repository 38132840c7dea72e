"""Per-optimizer-step metrics: stdout, metrics.jsonl, wandb; a PNG of the curves at the end.

Throughput counts the tokens actually processed (global batch in tokens per
step) and the label tokens among them; MFU uses model FLOPs per token
(6N plus causal attention, PaLM appendix B) against the device's dense peak.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PrinterCallback, TrainerCallback

from . import manifest as mf


class FP16OverflowError(RuntimeError):
    pass


class NonFiniteLossError(RuntimeError):
    pass


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    # 6N for the dense matmuls (fwd + bwd); attention scores and values: 12 * L * d * S,
    # halved for causal masking. Recompute is not counted (model FLOPs, not hardware FLOPs).
    return 6 * n_params + 6 * n_layers * hidden * seq_len


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Progress:
    """Optimizer steps done, tokens/s and time left, on rank 0: a live bar on a terminal; in a log file (not a
    TTY) one line per tenth of the run, so a log of thousands of steps gains ten lines, not thousands."""

    def __init__(self, total: int, done: int, tokens_per_step: int, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.start, self.tokens_per_step = total, done, tokens_per_step
        self.t0 = time.perf_counter()
        self.marks = sorted({math.ceil(total * k / 10) for k in range(1, 11)})
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, desc="train", unit="step", file=self.stream,
                            dynamic_ncols=True, mininterval=1)

    def update(self, step: int) -> None:
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0  # this attempt's steps per second
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate * self.tokens_per_step:,.0f} tok/s", refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if step not in self.marks:
            return
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        print(f"train: {step / self.total:4.0%} ({step}/{self.total} steps), {rate * self.tokens_per_step:,.0f} tok/s, "
              f"{_hms(elapsed)} elapsed, {_hms(eta)} left", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A log line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _non_finite(g: torch.Tensor) -> torch.Tensor:
    """1 if `g` holds an inf or NaN, as a tensor (no sync). Through its extremes: isfinite(g) of the vocab x hidden
    lm_head gradient would allocate 2 bytes per element (about 1 GiB at 8B); amax/amin propagate NaN and inf."""
    return (~torch.isfinite(torch.stack([g.amax(), g.amin()]))).any().int()


def scaler_gave_up(exc: BaseException) -> FP16OverflowError | None:
    """DeepSpeed's dynamic loss scaler raises a plain Exception on an overflow at the minimum scale once its
    hysteresis is spent (deepspeed 0.19.8 runtime/fp16/loss_scaler.py:256-259; raise_error_at_min_scale is not
    configurable, precision_config.py:202-209), inside optimizer.step, before any callback sees the step: the
    run's own at-minimum count never gets there. Said in zerotune's words, or None for any other exception."""
    if "loss scale already at minimum" not in str(exc):
        return None
    return FP16OverflowError(
        "fp16 gradients overflowed again at DeepSpeed's minimum loss scale (fp16.min_loss_scale): training has "
        "diverged, and a smaller scale is not allowed. metrics.jsonl shows the loss scale falling and, with Liger, "
        "whether lm_head's gradient was inf/NaN before loss scaling (lm_head_grad_nonfinite_unscaled). Lower "
        "train.lr, check the data for extreme samples, or use bf16 on sm80+ GPUs. The last committed checkpoint "
        "is intact.")


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


class StepMetrics(TrainerCallback):
    def __init__(self, path: Path, tokens_per_step: int, label_fraction: float, flops_tok: float,
                 peak_tflops: float | None, world_size: int, max_overflows_at_min_scale: int = 5):
        self.path = Path(path)
        self.tokens_per_step = tokens_per_step
        self.label_fraction = label_fraction
        self.flops_tok = flops_tok
        self.peak = peak_tflops
        self.world = world_size
        self.max_overflows = max_overflows_at_min_scale
        self.trainer = None
        self._hooks: list = []  # handles of the hooks this callback put on the model: detach() removes them
        self._t0 = None
        self._overflows_at_min = 0
        self._labels = None  # label tokens seen this step on this rank (a tensor: no sync per micro-batch)
        self.counting = False
        self.watching_grads = False
        self._grad_zero, self._grad_total = None, 0  # zero gradient elements / all, this step, this rank
        self.checking_head, self._head_bad = False, None  # micro-batches with a non-finite lm_head gradient
        self._head_unscaled_bad = None  # ... whose gradient was already non-finite before loss scaling (Liger)
        self.head_bad_total, self._head_unscaled_steps = 0, 0
        self.rows: list[dict] = []
        self.progress: Progress | None = None

    def attach(self, trainer) -> None:
        """Read the DeepSpeed engine from `trainer`; this callback prints each logged step, so the Trainer's
        own dict printer (added when disable_tqdm=True) would print it twice."""
        self.trainer = trainer
        trainer.remove_callback(PrinterCallback)

    def detach(self) -> None:
        """After training: remove the hooks and forget the Trainer. A hook on a parameter that C++ keeps alive
        (QLoRA, issue 19) would otherwise hold this callback, hence the Trainer and the trained model."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.trainer = None

    def count_labels(self, model) -> None:
        """Count the label tokens each micro-batch really carries (the data set's average fraction misleads on
        short runs: a 1,024-token packed row held 611 to 921 label tokens in the benchmark)."""
        def hook(module, args, kwargs):
            labels = kwargs.get("labels")
            if module.training and labels is not None:
                n = (labels != -100).sum()
                self._labels = n if self._labels is None else self._labels + n

        self._hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        self.counting = True

    def watch_grads(self, model, n_params: int = 4, check_lm_head: bool = False) -> None:
        """Fraction of gradient elements exactly 0 in the training dtype, per step, on a few weight matrices
        spread over the depth: fp16 gradients below 2^-24 (after loss scaling) flush to zero, and at a large
        GA each micro-batch's gradients are ~1/GA of the usual size. The tensor hook sees each micro-batch's
        gradient as autograd produced it (loss-scaled, model dtype), before ZeRO-3 reduces and accumulates it
        in fp32. Embeddings and lm_head are left out (rows of tokens absent from the batch are truly 0), and so
        is LoRA A (its gradient is 0 while B is still at its zero init).

        check_lm_head: count micro-batches whose lm_head gradient holds inf/NaN, and tell apart the two causes.
        Liger's fused CE builds that gradient in forward, before loss scaling, in the 16-bit weight dtype
        (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py:116 `torch.zeros_like(weight)`, :375 `+=` per
        chunk below sm80), saves it for backward (:574-578), and multiplies it there by the upstream gradient,
        which carries the loss scale (:438-450). So the gradient autograd hands on (the tensor hook) can be
        inf from ordinary loss-scale overflow, which DeepSpeed's scaler cures by skipping the step and halving
        the scale (deepspeed/runtime/fp16/loss_scaler.py:256-274, hysteresis 2); the gradient Liger saved
        (found in the loss's graph by a forward hook) being non-finite is an overflow lowering the scale cannot
        cure. safety_checks() stops on the second only, and on the first only when it persists at the minimum
        loss scale."""
        skip = ("embed", "lm_head", "lora_A")
        cands = [p for name, p in model.named_parameters()
                 if p.requires_grad and len(getattr(p, "ds_shape", p.shape)) >= 2  # ZeRO-3: p.shape is (0,)
                 and not any(s in name for s in skip)]
        if not cands:
            return
        picked = [cands[round(i * (len(cands) - 1) / max(1, n_params - 1))] for i in range(min(n_params, len(cands)))]

        def hook(g):
            z, t = (g == 0).sum(), g.numel()
            self._grad_zero = z if self._grad_zero is None else self._grad_zero + z
            self._grad_total += t
            return g

        self._grad_zero, self._grad_total = None, 0
        head = model.get_output_embeddings() if check_lm_head and hasattr(model, "get_output_embeddings") else None
        if head is not None and head.weight.requires_grad:
            def head_hook(g):
                bad = _non_finite(g)
                self._head_bad = bad if self._head_bad is None else self._head_bad + bad
                return g

            def unscaled_hook(module, args, output):
                g = liger_saved_head_grad(output) if module.training else None
                if g is not None:
                    bad = _non_finite(g)
                    self._head_unscaled_bad = bad if self._head_unscaled_bad is None else self._head_unscaled_bad + bad

            self._hooks.append(head.weight.register_hook(head_hook))
            self._hooks.append(model.register_forward_hook(unscaled_hook))
            self.checking_head = True
        for p in dict.fromkeys(picked):  # a short model may pick one parameter twice
            self._hooks.append(p.register_hook(hook))
        self.watching_grads = True

    def rewind(self, step: int) -> None:
        """On resume from checkpoint `step`, rows logged after it by the interrupted attempt (a kill -9 lands
        between checkpoints) are moved to metrics.discarded.jsonl, so each step appears once. Step 0: a fresh run."""
        discarded = self.path.with_name("metrics.discarded.jsonl")
        dropped = mf.rewind_jsonl(self.path, step, discard_to=discarded)
        if dropped:
            print(f"train: metrics: moved {dropped} rows logged after step {step} by the interrupted attempt "
                  f"to {discarded}", flush=True)

    def on_train_begin(self, args, state, control, **kw):
        if state.is_world_process_zero:
            eng = self._engine()
            if eng is not None and eng.zero_use_cpu_optimizer():
                # accelerate replaces the Trainer's torch AdamW with DeepSpeed's CPU Adam under offload
                # (accelerator.py, map_pytorch_optim_to_deepspeed): say which one steps the weights
                print(f"train: optimizer offloaded to the CPU: {type(eng.basic_optimizer).__name__} steps the fp32 "
                      f"master weights and Adam moments in host RAM", flush=True)
            self.progress = Progress(state.max_steps, state.global_step, self.tokens_per_step)

    def on_train_end(self, args, state, control, **kw):
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def on_step_begin(self, args, state, control, **kw):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def _engine(self):
        eng = getattr(self.trainer, "model_wrapped", None) if self.trainer else None
        return eng if hasattr(eng, "optimizer") and hasattr(eng, "skipped_steps") else None

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        dt = now - (self._t0 or now)
        self._t0 = now
        mem = torch.tensor(float(peak_memory_bytes(args.device)))
        labels = torch.tensor(float(self._labels if self._labels is not None else 0))
        self._labels = None
        if dist.is_available() and dist.is_initialized():
            mem, labels = mem.to(args.device), labels.to(args.device)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            dist.all_reduce(labels, op=dist.ReduceOp.SUM)
        n_labels = labels.item() if self.counting else self.tokens_per_step * self.label_fraction
        grad_zero = None
        if self.watching_grads:
            zt = torch.tensor([float(self._grad_zero if self._grad_zero is not None else 0), float(self._grad_total)])
            self._grad_zero, self._grad_total = None, 0
            if dist.is_available() and dist.is_initialized():
                zt = zt.to(args.device)
                dist.all_reduce(zt, op=dist.ReduceOp.SUM)
            grad_zero = zt[0].item() / zt[1].item() if zt[1].item() > 0 else None
        head_bad = head_unscaled = None
        if self.checking_head:
            hb = torch.tensor([float(self._head_bad if self._head_bad is not None else 0),
                               float(self._head_unscaled_bad if self._head_unscaled_bad is not None else 0)])
            self._head_bad = self._head_unscaled_bad = None
            if dist.is_available() and dist.is_initialized():
                hb = hb.to(args.device)
                dist.all_reduce(hb, op=dist.ReduceOp.SUM)
            head_bad, head_unscaled = int(hb[0].item()), int(hb[1].item())
            self.head_bad_total += head_bad
        row = {"step": state.global_step, "step_time_s": round(dt, 4),
               "tokens_per_s": round(self.tokens_per_step / dt, 1) if dt > 0 else None,
               "tokens_per_s_per_rank": round(self.tokens_per_step / dt / self.world, 1) if dt > 0 else None,
               "label_tokens": int(n_labels),
               "label_tokens_per_s": round(n_labels / dt, 1) if dt > 0 else None,
               "peak_mem_gib_max_rank": round(mem.item() / 2**30, 3)}
        if grad_zero is not None:
            row["grad_zero_frac"] = round(grad_zero, 6)
        if head_bad is not None:
            row["lm_head_grad_nonfinite"] = head_bad
            row["lm_head_grad_nonfinite_unscaled"] = head_unscaled
        if self.peak and dt > 0:
            row["mfu"] = round(self.flops_tok * self.tokens_per_step / dt / (self.peak * 1e12 * self.world), 4)
        eng, min_scale = self._engine(), None
        if eng is not None and args.fp16:
            scale = float(getattr(eng.optimizer, "loss_scale", getattr(eng.optimizer, "cur_scale", float("nan"))))
            row["loss_scale"] = scale
            row["skipped_steps"] = int(eng.skipped_steps)
            row["overflow"] = bool(getattr(eng.optimizer, "overflow", False))  # this step was skipped
            min_scale = (float(eng.config.get("fp16", {}).get("min_loss_scale", 1))
                         if hasattr(eng, "config") and isinstance(eng.config, dict) else 1.0)
        self.safety_checks(row, state.global_step, min_scale)
        self.rows.append(row)
        if self.progress is not None:
            self.progress.update(state.global_step)

    def safety_checks(self, row: dict, step: int, min_scale: float | None) -> None:
        """Stop the run (on every rank: the inputs were reduced) when fp16 cannot recover by itself. Each skipped
        step costs hours at 8B, so what loss scaling cannot cure stops at once; what it can, only when it persists
        at the minimum scale (min_scale: DeepSpeed's; None without a loss scaler), where nothing is left to lower.
        DeepSpeed's own scaler raises there first (scaler_gave_up); the count is for a scaler that does not."""
        at_min = min_scale is not None and row.get("overflow", False) and row["loss_scale"] <= min_scale
        self._overflows_at_min = self._overflows_at_min + 1 if at_min else 0
        if row.get("lm_head_grad_nonfinite_unscaled"):
            self._head_unscaled_steps += 1
        else:
            self._head_unscaled_steps = 0
        if self._head_unscaled_steps >= min(2, self.max_overflows):  # Liger's own sum: no scale can cure it
            raise FP16OverflowError(
                f"lm_head's gradient was inf/NaN before loss scaling in {self._head_unscaled_steps} steps in a row "
                f"(step {step}): Liger's fused cross entropy sums it in fp16 in forward, so DeepSpeed lowering the "
                "scale cannot fix it. Use train.liger=off with a shorter data.seq_len (`zerotune plan` shows what "
                "fits), or bf16 on sm80+ GPUs. The last committed checkpoint is intact.")
        if self._overflows_at_min >= self.max_overflows:
            raise FP16OverflowError(
                f"fp16 gradients overflowed {self._overflows_at_min} steps in a row at the minimum loss scale "
                f"{min_scale:g} (step {step}): training has diverged. Lower train.lr, check the data "
                "for extreme samples, or use bf16 on sm80+ GPUs. The last committed checkpoint is intact.")

    def amend(self, step: int, fields: dict) -> None:
        """Add measurements made after the step's row was written (validation runs after the step's save)."""
        for row in self.rows:
            if row["step"] == step:
                row.update(fields)
        if self.path.exists():
            mf.amend_jsonl(self.path, step, fields)

    def on_log(self, args, state, control, logs=None, **kw):
        logs = dict(logs or {})
        loss = logs.get("loss")
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteLossError(f"loss is {loss} at step {state.global_step}: stopping before it reaches a checkpoint. "
                                     "Check the data (a sequence with no label tokens gives 0/0) and the learning rate.")
        if not state.is_world_process_zero or "loss" not in logs:
            return
        row = self.rows[-1] if self.rows and self.rows[-1]["step"] == state.global_step else {"step": state.global_step}
        row.update({k: logs[k] for k in ("loss", "grad_norm", "learning_rate", "epoch") if k in logs})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mf.append_jsonl(self.path, row)
        parts = [f"step {row['step']}", f"loss {row.get('loss', float('nan')):.4f}"]
        if "grad_norm" in row:
            parts.append(f"grad_norm {row['grad_norm']:.3f}")
        if "learning_rate" in row:
            parts.append(f"lr {row['learning_rate']:.2e}")
        if row.get("tokens_per_s"):
            parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
        if "mfu" in row:
            parts.append(f"MFU {row['mfu']:.1%}")
        parts.append(f"peak mem {row.get('peak_mem_gib_max_rank', 0):.2f} GiB")
        if "grad_zero_frac" in row:
            parts.append(f"zero grads {row['grad_zero_frac']:.2%}")
        if row.get("lm_head_grad_nonfinite") or row.get("lm_head_grad_nonfinite_unscaled"):
            parts.append(f"lm_head grad inf/NaN in {row['lm_head_grad_nonfinite']} micro-batches "
                         f"({row['lm_head_grad_nonfinite_unscaled']} before loss scaling)")
        if "loss_scale" in row:
            parts.append(f"loss scale {row['loss_scale']:g} (skipped {row['skipped_steps']})")
        line = "train: " + ", ".join(parts)
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)


def plot_curves(jsonl: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = mf.read_jsonl(jsonl)
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot([r["step"] for r in rows if "loss" in r], [r["loss"] for r in rows if "loss" in r], color="#4477aa",
           label="training")
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:  # validation loss (evaluation.py) sits in the rows of the steps it was measured at
        a.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="#ee6677", label="validation")
        a.legend(fontsize=8)
    a.set_xlabel("optimizer step")
    a.set_ylabel("loss (nats / label token)")
    a.set_yscale("log")  # the interesting part of a fine-tuning curve is the tail
    a.set_title("Loss")
    b.plot(steps, [r.get("tokens_per_s") or 0 for r in rows], color="#228833")
    b.set_xlabel("optimizer step")
    b.set_ylabel("tokens / s (all ranks)")
    b.set_title("Throughput")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
