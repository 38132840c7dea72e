"""Build the DeepSpeed config: the shipped JSON plus the recipe's `train.zero` overrides.

Keys the Trainer owns stay "auto" for the Trainer to fill. Two fp16 keys are zerotune's "auto",
resolved here from the batch plan (batch.py derives GA; nothing restates it): the initial loss
scale and the scale window. DeepSpeed itself never sees "auto" for them.
"""

from __future__ import annotations

import copy
import json
import math

from .config import Recipe, resolve_path
from .errors import MissingInputError, UserError, why_unreadable

# DeepSpeed's own fp16 defaults (deepspeed/runtime/constants.py), used when nothing better is known.
DS_INITIAL_SCALE_POWER = 16
DS_LOSS_SCALE_WINDOW = 1000
# The Trainer normalises each micro-batch loss by the label tokens of the whole global batch (and
# multiplies by the world size: transformers/trainer.py compute_loss), so one micro-batch's gradients
# are ~1/GA of a GA-1 run's. Raising the initial scale by log2(GA) restores DeepSpeed's default
# headroom. The premise holds on average, not for every micro-batch (unpacked data with very uneven
# lengths can put most of a batch's label tokens in one micro-batch): a scale k powers too high costs
# k + 1 skipped steps (hysteresis 2, then one halving per overflow: deepspeed/runtime/fp16/
# loss_scaler.py update_scale). The cap of 8 extra powers (2^24) bounds that worst case at 9 skipped
# steps and covers GA up to 256 exactly; above it (GA 480: 2^25 ideal) the window lets the scaler grow.
MAX_EXTRA_SCALE_POWER = 8
MIN_LOSS_SCALE_WINDOW = 10  # fewer steps between growth attempts would mostly buy overflows and skipped steps


# A preference pair's completion tokens before `make data` has counted them (the data manifest's label tokens per
# row after it): Llama-3.1's UltraFeedback answers run ~300 tokens; a power of two above, stated where it is used.
ASSUMED_LABEL_TOKENS_PER_ROW = 512
DPO_START_SIGMOID = 0.5  # sigma(-beta x margin) at the first steps: the policy starts as the reference, margin 0


def micro_step_weight(r: Recipe, grad_accum: int, label_tokens_per_row: float | None = None) -> float:
    """What one micro-batch's loss weighs on its label tokens' log-probabilities, summed, relative to a loss that
    is the mean over the micro-batch's own label tokens (an SFT micro-batch at GA 1: 1). The fp16 scale divides by
    it (loss_scale), so every objective starts with DeepSpeed's default headroom.

    SFT: each token weighs 1 / (GA x its micro-batch's labels) (the Trainer's global normalisation): 1 / GA.
    DPO (preference/loss.py, the Trainer dividing the pair mean by GA): each completion token's log-probability
    weighs beta x sigma(-z) / (pairs x GA), sigma = DPO_START_SIGMOID at the start; the micro-batch holds
    2 x pairs x label_tokens_per_row of them: beta x sigma x 2 x label_tokens_per_row / GA. The NLL term
    (preference.nll_alpha, a mean over the chosen tokens: nll_alpha / (pairs x labels x GA) each, on the same
    2 x pairs x labels tokens) adds 2 x nll_alpha / GA.
    GRPO (rl/loss.py, Liger's formula): a completion token's log-probability weighs |A| / (rows x its completion's
    tokens x GA) (`grpo`; `dr_grpo`: / (rows x max_new_tokens x GA), no more): over the micro-batch, mean |A| / GA.
    Scaled advantages ((r - mean) / unbiased std) have mean A^2 = (G - 1) / G in every group with spread, so mean |A|
    <= sqrt((G - 1) / G) < 1: SFT's headroom. Unscaled (Dr. GRPO) |A| is the reward's spread: for rewards in [0, 1]
    (every scorer) mean |A| <= 1/2. A user's reward on a wider range overflows the first steps, and DeepSpeed's
    dynamic scale halves down to it."""
    if r.grpo:
        g = r.rl.group_size
        return (math.sqrt((g - 1) / g) if r.rl.scale_rewards else 0.5) / grad_accum
    if not r.pairs:
        return 1 / grad_accum
    labels = label_tokens_per_row or ASSUMED_LABEL_TOKENS_PER_ROW
    p = r.preference
    return (p.beta * DPO_START_SIGMOID * 2 * labels + 2 * p.nll_alpha) / grad_accum


def loss_scale(grad_accum: int | None, steps: int | None, weight: float | None = None) -> tuple[int, int]:
    """(initial_scale_power, loss_scale_window) for fp16 dynamic loss scaling. weight: micro_step_weight (default
    1 / grad_accum, SFT's): DeepSpeed's 2^16 over it, rounded down to a power of two (never more headroom used
    than DeepSpeed's default gives a mean-normalised loss), within MAX_EXTRA_SCALE_POWER powers either way."""
    power = DS_INITIAL_SCALE_POWER
    if weight is None and grad_accum and grad_accum > 1:
        weight = 1 / grad_accum
    if weight:
        extra = math.floor(-math.log2(weight) + 1e-9)  # 1/GA at a power of two: exactly log2(GA)
        power += max(-MAX_EXTRA_SCALE_POWER, min(MAX_EXTRA_SCALE_POWER, extra))
    window = DS_LOSS_SCALE_WINDOW
    if steps:
        # DeepSpeed doubles the scale after `window` overflow-free steps: with 1000 a fine-tuning run of a
        # few dozen steps never adapts. A tenth of the run lets it grow a few times if it started too low.
        window = min(DS_LOSS_SCALE_WINDOW, max(MIN_LOSS_SCALE_WINDOW, steps // 10))
    return power, window


def build(r: Recipe, bp=None, steps: int | None = None, load_universal: bool = False,
          label_tokens_per_row: float | None = None) -> dict | None:
    """bp: the batch.BatchPlan of this run; steps: optimizer steps. Without them (planning before data
    exists) the fp16 scale keys fall back to DeepSpeed's defaults. load_universal: this run resumes from a
    universal conversion (reshard.py; read by engine.load_checkpoint, deepspeed runtime/engine.py:1712).
    label_tokens_per_row: the prepared data's (micro_step_weight; a preference run's scale depends on it)."""
    if r.train.deepspeed is None:
        return None
    path = resolve_path(r.train.deepspeed)
    if not path.exists():
        raise MissingInputError(f"train.deepspeed: {path} not found; use a shipped config from configs/deepspeed/ "
                                f"(e.g. train.deepspeed=configs/deepspeed/zero3.json) or null for no DeepSpeed.")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"train.deepspeed: {path} line {e.lineno}: not valid JSON ({e.msg}).") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"train.deepspeed: {path}: cannot be read ({why_unreadable(e)}); name a "
                        f"DeepSpeed JSON file, e.g. configs/deepspeed/zero3.json.") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("zero_optimization", {}), dict):
        raise UserError(f"train.deepspeed: {path}: a DeepSpeed config is a JSON object whose zero_optimization is an "
                        f"object too (configs/deepspeed/zero3.json is one).")
    zero = copy.deepcopy(cfg.get("zero_optimization", {}))
    for key, value in _numbers(r.train.zero).items():
        if isinstance(value, dict) and isinstance(zero.get(key), dict):
            zero[key] = {**zero[key], **value}
        else:
            zero[key] = value
    cfg["zero_optimization"] = zero
    if load_universal:
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": True}
    fp16 = cfg.get("fp16")
    if isinstance(fp16, dict):
        power, window = loss_scale(bp.grad_accum if bp else None, steps,
                                   micro_step_weight(r, bp.grad_accum, label_tokens_per_row) if bp else None)
        # Only zerotune's "auto": a number written in a user's JSON is their choice and stays.
        if fp16.get("initial_scale_power") == "auto":
            fp16["initial_scale_power"] = power
        if fp16.get("loss_scale_window") == "auto":
            fp16["loss_scale_window"] = window
    return cfg


def _numbers(v):
    """PyYAML reads `1e8` (no dot) as the string '1e8'; DeepSpeed's config wants the number."""
    if isinstance(v, dict):
        return {k: _numbers(x) for k, x in v.items()}
    if isinstance(v, str) and v.strip().lower() not in ("nan", "inf", "-inf", "infinity"):
        try:
            f = float(v)
        except ValueError:
            return v
        return int(f) if f.is_integer() else f
    return v


def amp_grad_scaler(grad_accum: int, steps: int | None, device: str = "cuda"):
    """The same rule for fp16 without DeepSpeed (QLoRA on a T4): accelerate builds torch's GradScaler with
    its defaults (2^16, growth every 2,000 steps) and the Trainer passes it no options, so the worker swaps
    in this one before training (accelerate hands `accelerator.scaler` to the optimizer at prepare time)."""
    import torch

    power, window = loss_scale(grad_accum, steps)
    return torch.amp.GradScaler(device, init_scale=2.0 ** power, growth_interval=window)
