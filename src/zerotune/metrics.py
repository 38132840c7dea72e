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


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    # 6N for the dense matmuls (fwd + bwd); attention scores and values: 12 * L * d * S,
    # halved for causal masking. Recompute is not counted (model FLOPs, not hardware FLOPs).
    return 6 * n_params + 6 * n_layers * hidden * seq_len


def attention_squares(input_ids, position_ids=None) -> int:
    """Sum over the micro-batch's attended spans of length^2: each document where the position ids restart (packed
    rows: what sdpa_docs and FlashAttention's varlen attend), else each row whole (padded rows: their padded
    length, which the kernel computes). Under sequence parallelism the slice's own ids: a document cut by the slice
    boundary counts as two (a lower bound)."""
    import torch

    rows, n = input_ids.shape
    if position_ids is None:
        return rows * n * n
    pos = position_ids.reshape(-1, position_ids.shape[-1]).long()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    total = 0
    for row in starts.cpu():
        s = torch.nonzero(row).flatten()
        lengths = torch.diff(torch.cat([s, torch.tensor([n])]))
        total += int((lengths.long() ** 2).sum())
    return total


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Progress:
    """Optimizer steps done, tokens/s and time left, on rank 0: a live bar on a terminal; in a log file (not a
    TTY) one line per tenth of the run, so a log of thousands of steps gains ten lines, not thousands."""

    def __init__(self, total: int, done: int, tokens_per_step: int | None, stream=None, label: str = "finetune",
                 unit: str = "step"):
        self.stream = stream or sys.stderr
        self.total, self.start, self.tokens_per_step = total, done, tokens_per_step
        self.label, self.unit = label, unit
        self.t0 = time.perf_counter()
        self.marks = sorted({math.ceil(total * k / 10) for k in range(1, 11)})
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, desc=label, unit=unit, file=self.stream,
                            dynamic_ncols=True, mininterval=1)

    def update(self, step: int) -> None:
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0  # this attempt's steps per second
        speed = f"{rate * self.tokens_per_step:,.0f} tok/s" if self.tokens_per_step else ""
        if self.bar is not None:
            self.bar.set_postfix_str(speed, refresh=False) if speed else None
            self.bar.update(step - self.bar.n)
            return
        if step not in self.marks:
            return
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        print(f"{self.label}: {step / self.total:4.0%} ({step}/{self.total} {self.unit}s), {speed + ', ' if speed else ''}"
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


def dist_if_initialized():
    """torch.distributed when a process group is initialised (the ranks of one run), else None (one process)."""
    return dist if dist.is_available() and dist.is_initialized() else None


def over_ranks(values: list, op: str, device) -> list[float]:
    """`values` (numbers or 0-d tensors) reduced over all ranks, op "sum" or "max": the same list on every rank;
    in a single process, the values themselves. One collective for the whole list."""
    t = torch.tensor([float(v) for v in values])
    if dist_if_initialized():
        t = t.to(device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def max_over_ranks(value: float, device) -> float:
    """The largest `value` over every rank (this rank's alone outside a process group): how ranks agree on a stop."""
    return over_ranks([value], "max", device)[0]


def deepspeed_engine(trainer):
    """The Trainer's DeepSpeed engine, or None (no Trainer yet, or no DeepSpeed)."""
    eng = getattr(trainer, "model_wrapped", None) if trainer else None
    return eng if hasattr(eng, "optimizer") and hasattr(eng, "skipped_steps") else None


def fp16_scaler(eng) -> dict:
    """DeepSpeed's fp16 loss scaler after this step: the scale, the steps skipped so far, whether this step
    overflowed (and was skipped), and the configured minimum scale."""
    opt = eng.optimizer
    return {"loss_scale": float(getattr(opt, "loss_scale", getattr(opt, "cur_scale", float("nan")))),
            "skipped_steps": int(eng.skipped_steps),
            "overflow": bool(getattr(opt, "overflow", False)),
            "min_loss_scale": (float(eng.config.get("fp16", {}).get("min_loss_scale", 1))
                               if hasattr(eng, "config") and isinstance(eng.config, dict) else 1.0)}


class StepMetrics(TrainerCallback):
    """One row per optimizer step: measured at the step's end on every rank (reduced over ranks), printed and
    appended to metrics.jsonl by rank 0 when the Trainer logs the step. Stopping the run is not its job:
    safety.SafetyChecks, before it in the Trainer's callbacks, judges each step and loss before it is logged.

    safety: that SafetyChecks; what it found this step (lm_head's non-finite gradients) goes into the row."""

    def __init__(self, path: Path, tokens_per_step: int, label_fraction: float, flops_tok: float,
                 peak_tflops: float | None, world_size: int, safety=None):
        self.path = Path(path)
        self.tokens_per_step = tokens_per_step
        self.label_fraction = label_fraction
        self.flops_tok = flops_tok
        self.peak = peak_tflops
        self.world = world_size
        self.safety = safety
        self.trainer = None
        self._hooks: list = []  # handles of the hooks this callback put on the model: detach() removes them
        self._t0 = None
        self._labels = None  # label tokens seen this step on this rank (a tensor: no sync per micro-batch)
        self.counting = False
        self.watching_grads = False
        self._grad_zero, self._grad_total = None, 0  # zero gradient elements / all, this step, this rank
        self.shape = None  # (parameters, layers, hidden) when count_labels counts what each micro-batch processes
        self._tokens, self._squares = 0, 0  # this step, this rank: tokens processed, attention's sum of spans^2
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

    def count_labels(self, model, shape: tuple[int, int, int] | None = None) -> None:
        """Count the label tokens each micro-batch really carries (the data set's average fraction misleads on
        short runs: a 1,024-token packed row held 611 to 921 label tokens in the benchmark). shape: (parameters,
        layers, hidden): also count the tokens each micro-batch processes (padding included) and the model FLOPs
        of their attention as it runs (attention_squares), so tokens/s and MFU are what ran, not the planned bound
        (a DPO pair's 2 x seq_len; a full row's attention where documents attend to themselves)."""
        self.shape = shape

        def hook(module, args, kwargs):
            labels = kwargs.get("labels")
            if module.training and labels is not None:
                n = (labels != -100).sum()
                self._labels = n if self._labels is None else self._labels + n
                ids = kwargs.get("input_ids")
                if shape is not None and ids is not None:
                    self._tokens += ids.numel()
                    self._squares += attention_squares(ids, kwargs.get("position_ids"))

        self._hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        self.counting = True

    def watch_grads(self, model, n_params: int = 4) -> None:
        """Fraction of gradient elements exactly 0 in the training dtype, per step, on a few weight matrices
        spread over the depth: fp16 gradients below 2^-24 (after loss scaling) flush to zero, and at a large
        GA each micro-batch's gradients are ~1/GA of the usual size. The tensor hook sees each micro-batch's
        gradient as autograd produced it (loss-scaled, model dtype), before ZeRO-3 reduces and accumulates it
        in fp32. Embeddings and lm_head are left out (rows of tokens absent from the batch are truly 0), and so
        is LoRA A (its gradient is 0 while B is still at its zero init). lm_head's non-finite gradients are
        safety.LmHeadOverflow's to count."""
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
        for p in dict.fromkeys(picked):  # a short model may pick one parameter twice
            self._hooks.append(p.register_hook(hook))
        self.watching_grads = True

    def rewind(self, step: int) -> None:
        """On resume from checkpoint `step`, rows logged after it by the interrupted attempt (a kill -9 lands
        between checkpoints) are moved to metrics.discarded.jsonl, so each step appears once. Step 0: a fresh run."""
        discarded = self.path.with_name("metrics.discarded.jsonl")
        dropped = mf.rewind_jsonl(self.path, step, discard_to=discarded)
        if dropped:
            print(f"finetune: metrics: moved {dropped} rows logged after step {step} by the interrupted attempt "
                  f"to {discarded}", flush=True)

    def on_train_begin(self, args, state, control, **kw):
        if state.is_world_process_zero:
            eng = deepspeed_engine(self.trainer)
            if eng is not None and eng.zero_use_cpu_optimizer():
                # accelerate replaces the Trainer's torch AdamW with DeepSpeed's CPU Adam under offload
                # (accelerator.py, map_pytorch_optim_to_deepspeed): say which one steps the weights
                print(f"finetune: optimizer offloaded to the CPU: {type(eng.basic_optimizer).__name__} steps the fp32 "
                      f"master weights and Adam moments in host RAM", flush=True)
            self.progress = Progress(state.max_steps, state.global_step, self.tokens_per_step)

    def on_train_end(self, args, state, control, **kw):
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def on_step_begin(self, args, state, control, **kw):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        dt = now - (self._t0 or now)
        self._t0 = now
        (mem,) = over_ranks([peak_memory_bytes(args.device)], "max", args.device)
        labels, grad_zero, grad_total, tokens, squares = over_ranks(
            [self._labels if self._labels is not None else 0, self._grad_zero if self._grad_zero is not None else 0,
             self._grad_total, self._tokens, self._squares], "sum", args.device)
        self._labels, self._grad_zero, self._grad_total, self._tokens, self._squares = None, None, 0, 0, 0
        n_labels = labels if self.counting else self.tokens_per_step * self.label_fraction
        if self.shape is None or not tokens:  # what the step was planned to process
            tokens, flops = self.tokens_per_step, self.flops_tok * self.tokens_per_step
        else:  # what it processed: 6N per token + 12 L d per causal (query, key) pair, half of each span^2
            n_params, layers, hidden = self.shape
            flops = 6 * n_params * tokens + 6 * layers * hidden * squares
        row = {"step": state.global_step, "step_time_s": round(dt, 4),
               "tokens_per_s": round(tokens / dt, 1) if dt > 0 else None,
               "tokens_per_s_per_rank": round(tokens / dt / self.world, 1) if dt > 0 else None,
               "label_tokens": int(n_labels),
               "label_tokens_per_s": round(n_labels / dt, 1) if dt > 0 else None,
               "peak_mem_gib_max_rank": round(mem / 2**30, 3)}
        if self.watching_grads and grad_total > 0:
            row["grad_zero_frac"] = round(grad_zero / grad_total, 6)
        if self.safety is not None:
            row.update(self.safety.found)  # lm_head_grad_nonfinite, lm_head_grad_nonfinite_unscaled
        if self.peak and dt > 0:
            row["mfu"] = round(flops / dt / (self.peak * 1e12 * self.world), 4)
        eng = deepspeed_engine(self.trainer)
        if eng is not None and args.fp16:
            scaler = fp16_scaler(eng)
            row.update({k: scaler[k] for k in ("loss_scale", "skipped_steps", "overflow")})  # overflow: skipped
        self.rows.append(row)
        if self.progress is not None:
            self.progress.update(state.global_step)

    def amend(self, step: int, fields: dict) -> None:
        """Add measurements made after the step's row was written (validation runs after the step's save)."""
        for row in self.rows:
            if row["step"] == step:
                row.update(fields)
        if self.path.exists():
            mf.amend_jsonl(self.path, step, fields)

    def on_log(self, args, state, control, logs=None, **kw):
        logs = dict(logs or {})
        if not state.is_world_process_zero or "loss" not in logs:
            return
        row = self.rows[-1] if self.rows and self.rows[-1]["step"] == state.global_step else {"step": state.global_step}
        row.update({k: logs[k] for k in ("loss", "grad_norm", "learning_rate", "epoch") if k in logs})
        # an objective's own statistics (DPO: rewards/accuracy, rewards/margin, logps/...; preference/objective.py;
        # GRPO: rl/reward, rl/zero_std_groups, ...; rl/objective.py)
        row.update({k: v for k, v in logs.items() if k.startswith(("rewards/", "logps/", "rl/"))})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mf.append_jsonl(self.path, row)
        parts = [f"step {row['step']}", f"loss {row.get('loss', float('nan')):.4f}"]
        if "grad_norm" in row:
            parts.append(f"grad_norm {row['grad_norm']:.3f}")
        if "rewards/accuracy" in row:
            parts.append(f"reward acc {row['rewards/accuracy']:.3f} margin {row['rewards/margin']:.4f}")
        if "rl/reward" in row:  # GRPO: what the rollouts scored, and how much of the step could teach anything
            parts.append(f"reward {row['rl/reward']:.3f} +- {row['rl/reward_std']:.3f}, groups without spread "
                         f"{row['rl/zero_std_groups']:.0%}"
                         + (f", skipped {row['rl/skipped_groups']:.0f}" if "rl/skipped_groups" in row else "")
                         + f", completions {row['rl/completion_tokens']:.1f} tok ({row['rl/truncated']:.0%} cut), "
                           f"clipped {row['rl/clip_fraction']:.1%}"
                         + (f", KL {row['rl/kl']:.2e}" if "rl/kl" in row else "")
                         + f", rollout {row['rl/rollout_s']:.1f}s")
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
        line = "finetune: " + ", ".join(parts)
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
    if val:  # validation loss (train/validation.py) sits in the rows of the steps it was measured at
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
