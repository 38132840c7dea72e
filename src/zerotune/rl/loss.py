"""GRPO's loss for a micro-batch of rollouts, computed inside the model's forward, without vocabulary-wide logits.

A micro-batch is m prompts x G completions, one row each: the prompt's tokens, then the completion's (its label
tokens, up to and including the end-of-turn token where it stopped), right-padded (rollout.py). Each row carries its
advantage (rewards.py: the completion's reward against its group's).

The formula is liger-kernel's: `LigerFusedLinearGRPOFunction.ppo_loss_fn` (liger_kernel 0.8.5
chunked_loss/grpo_loss.py:101-266) on the completions' per-token log-probs, arranged (rows, longest completion) with
their mask: per token -min(ratio x A, clip(ratio, 1 - eps, 1 + eps) x A), ratio = pi / pi_rollout; then `grpo` takes
each row's mean over its tokens and the mean over rows, `dr_grpo` the sum over tokens / (rows x max_new_tokens).
Both are means over rows, so the Trainer's division by grad-accum and DeepSpeed's average over ranks make them the
step's mean exactly (micro-batches hold equally many rows). One optimisation step per rollout batch, as TRL's default
(num_iterations 1): the rollout policy is the policy itself, pi_rollout = pi detached, so the ratio is 1 in value and
its gradient is A x grad log pi; the clip fraction is logged, and is 0 by construction until a batch is reused.

Why not Liger's fused GRPO loss whole (`LigerFusedLinearGRPOLoss`): in 0.8.5 it does stream its logits over sequence
and vocabulary chunks (fused_linear_ppo.py:18-70, 2,048 x 4,096 at a time), so memory is not the reason, as it is for
DPO (preference/loss.py). Precision is: it computes the hidden states' and lm_head's gradients in forward at unit loss
scale and casts them to the model's dtype (fused_linear_ppo.py:170-176, grad_input and grad_weight in 16 bits): in
fp16 (V100) a completion token's gradient, |A| / (rows x tokens) x p, falls below fp16's smallest normal (6e-5)
and loses its precision before DeepSpeed's loss scale ever reaches it. zerotune's fused path (preference/loss.py
FusedTokenLoss) scales that gradient into fp16's range and keeps lm_head's in fp32, the DPO path's tested answer. It
also meets lm_head only at completion tokens (Liger's takes every position of a (rows, T) block, pads included).
tests/test_grpo.py checks the two give the same loss and gradients in fp32.
"""

from __future__ import annotations

import torch

from ..preference.loss import FusedTokenLoss, attach_forward, label_positions, token_logps

KL_LOG_RATIO = 10.0  # |log pi_ref - log pi| past which a token's KL term stops growing (grpo_loss_fn)


def token_grid(rows, n_rows: int):
    """Each label position's column in its row's completion: the (rows, longest completion) layout Liger's formula
    takes. label_positions lists positions row by row, in order, so a token's column is its rank within its row."""
    counts = torch.bincount(rows, minlength=n_rows)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(len(rows), device=rows.device) - starts[rows]
    mask = torch.zeros(n_rows, int(counts.max()) if len(rows) else 0, device=rows.device)
    mask[rows, cols] = 1.0
    return cols, mask


def grpo_loss_fn(rows, n_rows: int, advantages, *, loss_type: str, epsilon: float, max_new_tokens: int,
                 old_logps=None, ref_logps=None, beta: float = 0.0):
    """(per-token log-probs of the policy at the label positions) -> (loss, (clip fraction,) or, with the KL term,
    (clip fraction, mean KL per token)): Liger's formula (module docstring). old_logps: the rollout policy's, per
    token; None = the policy's own, detached. ref_logps, beta: the starting model's per-token log-probs and the KL's
    weight (Liger's k3 estimator exp(ref - logp) - (ref - logp) - 1 per token, added to each token's loss)."""
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

    cols, mask = token_grid(rows, n_rows)

    def grid(x):
        return torch.zeros(mask.shape, dtype=x.dtype, device=x.device).index_put((rows, cols), x)

    def fn(x):
        ref = None
        if ref_logps is not None:
            # k3's gradient per token is beta x (1 - exp(ref - logp)), unbounded: one token the policy has made far
            # less likely than the start did would set the fused loss's fp16 scale for the whole micro-batch
            # (preference/loss.py) and flush every other token's gradient. The log-ratio is clamped at KL_LOG_RATIO
            # (the estimator is exact within it; verl clamps k3 itself at 10), bounding that gradient by e^10 x beta.
            ref = x.detach() + (ref_logps.float() - x.detach()).clamp(-KL_LOG_RATIO, KL_LOG_RATIO)
        loss, metrics = LigerFusedLinearGRPOFunction.ppo_loss_fn(
            per_token_logps=grid(x), attention_mask=mask, advantages=advantages.float(), full_attention_mask=mask,
            ref_per_token_logps=None if ref is None else grid(ref),
            old_per_token_logps=None if old_logps is None else grid(old_logps), epsilon_low=epsilon,
            epsilon_high=epsilon, beta=beta if ref_logps is not None else 0.0, loss_type=loss_type,
            max_completion_length=max_new_tokens)
        # Liger's metrics: [KL (with beta), clip fraction]
        return loss, (metrics[-1], *metrics[:-1])

    return fn


def rollout_forward(model, input_ids, position_ids, labels, advantages, loss_fn_of, chunk: int,
                    temperature: float, ref_logps=None):
    """The decoder, then GRPO's loss on the completions (advantages: (rows,); ref_logps: the starting model's
    per-token log-probs where the loss has a KL term), or, advantages None, their per-token log-probs without grad
    (the reference's pass). Runs inside the top module's forward, where ZeRO-3 gathered lm_head's weight."""
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    rows, pos, targets = label_positions(labels)
    weight = model.get_output_embeddings().weight
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if advantages is None:
        return {"logps": token_logps(hidden[rows, pos].detach(), weight, targets, chunk, softcap, temperature),
                "rows": rows}
    loss, logps, clipped, *kl = FusedTokenLoss.apply(hidden[rows, pos], weight, targets,
                                                     loss_fn_of(rows, input_ids.shape[0], advantages, ref_logps),
                                                     chunk, softcap, temperature)
    return {"loss": loss, "logps": logps, "rows": rows, "clip_fraction": clipped, **({"kl": kl[0]} if kl else {})}


def attach(model, loss_fn_of, chunk: int, temperature: float) -> None:
    """model(..., grpo_advantages=A[, grpo_ref_logps=...]) returns GRPO's loss on a micro-batch of rollouts,
    model(..., grpo_logps=True) their per-token log-probs (the KL's reference pass: LoRA's base, adapters off); every other call (generate,
    the save's probe, SFT-style validation) goes to the model's own forward. loss_fn_of(rows, n_rows, A, ref_logps)
    -> the per-token loss function (grpo_loss_fn with the recipe's settings)."""
    def route(kw, grpo_advantages=None, grpo_ref_logps=None, grpo_logps=False):
        if grpo_advantages is None and not grpo_logps:
            return None
        return rollout_forward(model, kw["input_ids"], kw.get("position_ids"), kw["labels"], grpo_advantages,
                               loss_fn_of, chunk, temperature, grpo_ref_logps)

    attach_forward(model, {"grpo_advantages": None, "grpo_ref_logps": None, "grpo_logps": False}, route)
