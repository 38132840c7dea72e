"""DPO's loss for a micro-batch of pairs, computed inside the model's forward, without vocabulary-wide logits.

A micro-batch is 2m rows: m chosen conversations, then their m rejected ones (objective.py collate). A row's
log-probability is the sum of log p(token) over its label tokens (the completion; formats.Pair), as TRL's DPOTrainer
sums them. The reference model's log-probabilities come precomputed (reference.py), so no second model exists.

The formula is liger-kernel's: `LigerFusedLinearDPOFunction.preference_loss_fn` (liger_kernel 0.8.5
chunked_loss/dpo_loss.py:9-140), every variant of it but ipo (which Liger itself refuses), on the per-row
log-probabilities: sigmoid = -log sigmoid(beta x ((pi_c - ref_c) - (pi_r - ref_r))), summed over the pairs and divided
by their number; rewards = beta x (pi - ref).

Why not Liger's fused DPO loss whole (`LigerFusedLinearDPOLoss`, fused_linear_preference.py): it chunks over pairs, not
tokens. Each chunk computes `input_chunk @ weight.t()` at every position of its 2 x chunk_size whole rows and then
`log_softmax(logits.float())` (fused_linear_preference.py:335-339): one pair of 4,096-token rows at Llama-3.1's 128,256
vocabulary is 1.05e9 logits, 2.1 GB in fp16 plus 4.2 GB in fp32 plus 4.2 GB of log-softmax, and torch.func's gradient
of it: the logits this path exists to avoid. It also takes the reference model's hidden states and lm_head weight
(ref_input, ref_weight), not log-probabilities computed once, so the reference model would stay in GPU memory.

So the log-probabilities are ours (`FusedTokenLoss`, plain torch, the same on CPU and GPU): only positions that predict a
label token meet lm_head (a prompt's tokens never do), `chunk_tokens` of them at a time, and, as Liger's fused losses
do, the gradients of the hidden states and of lm_head's weight are computed in forward: the log-probabilities first
(no grad), then the loss and its gradient per row on those few numbers, then each chunk's logits again to turn that
into gradients. lm_head's weight is then read only inside the model's forward, where ZeRO-3 has it gathered (the
worker registers it with the top module, as for Liger); backward only scales what forward saved.

Memory per micro-batch beyond the model's own activations (planner/memory.py preference_loss_bytes): one chunk's
logits, probabilities and their gradient in fp32 (~12 B x chunk x vocab), the label positions' hidden states and
their gradient (fp32), and lm_head's gradient in fp32 (4 B x vocab x hidden; 2.1 GB at 8B).
"""

from __future__ import annotations

import torch

IGNORE = -100
# 16-bit models: the logits' gradient (at most |d loss / d logp| per element, ~beta / pairs for sigmoid) is scaled up to
# this before its 16-bit matmul with lm_head's weight and unscaled after, so its small entries do not flush to zero
# (fp16 keeps magnitudes down to 6e-8). Less where the largest |d loss / d logp| would take an entry past FP16_ROOM:
# sppo_hard's is ~1 / beta, discopop's exp term grows with a negative margin (liger_kernel dpo_loss.py:117-144).
GRAD_SCALE = 1024.0
FP16_ROOM = 16384.0  # a quarter of fp16's 65,504: headroom for the matmul's sums


def label_positions(labels):
    """(row, position, target) of every position whose next token is a label: HF's shift (logits at t predict t+1)."""
    nxt = labels[:, 1:]
    rows, pos = (nxt != IGNORE).nonzero(as_tuple=True)
    return rows, pos, nxt[rows, pos]


def _logits(h, weight, softcap, temperature: float = 1.0):
    """The model's logits at h (Gemma's final softcap included), divided by the sampling temperature: a rollout's
    tokens were drawn from softmax(logits / temperature), so GRPO's log-probs are of that distribution (TRL's)."""
    z = (h @ weight.t()).float()
    z = softcap * torch.tanh(z / softcap) if softcap else z
    return z / temperature if temperature != 1.0 else z


def token_logps(h, weight, targets, chunk: int, softcap=None, temperature: float = 1.0):
    """log p(target) at each of the N label positions: (N,) fp32, `chunk` positions' logits at a time, no grad.
    h: (N, hidden) hidden states at those positions."""
    out = torch.empty(len(targets), dtype=torch.float32, device=h.device)
    with torch.no_grad():
        for s in range(0, len(targets), chunk):
            z = _logits(h[s:s + chunk], weight, softcap, temperature)
            out[s:s + chunk] = z.gather(1, targets[s:s + chunk, None])[:, 0] - torch.logsumexp(z, -1)
    return out


def sequence_logps(h, weight, targets, rows, n_rows: int, chunk: int, softcap=None):
    """Per row, the sum of log p(target) over its label positions: (n_rows,) fp32. rows: (N,) each position's row."""
    out = torch.zeros(n_rows, dtype=torch.float32, device=h.device)
    return out.index_add_(0, rows, token_logps(h, weight, targets, chunk, softcap))


class FusedTokenLoss(torch.autograd.Function):
    """loss_fn(per-token log-probs) with the gradients of h and lm_head's weight computed in forward (module
    docstring): the log-probs at the N label positions first (no grad), then the loss and its gradient per token on
    those N numbers, then each chunk's logits again to turn that into gradients. loss_fn: (N,) fp32 -> (loss, tuple
    of tensors it reports, e.g. per-row rewards). Returns (loss, per-token log-probs, *reported); only the loss is
    differentiable. DPO's loss reads per-row sums (pair_forward), GRPO's per-token values (rl/loss.py)."""

    @staticmethod
    def forward(ctx, h, weight, targets, loss_fn, chunk: int, softcap, temperature: float = 1.0):
        logps = token_logps(h, weight, targets, chunk, softcap, temperature)
        with torch.enable_grad():
            x = logps.detach().requires_grad_()
            loss, reported = loss_fn(x)
            (g,) = torch.autograd.grad(loss, x)  # d loss / d log p(token): each token's weight
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if h.requires_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if weight.requires_grad else None
        scale = 1.0 if weight.dtype == torch.float32 else _grad_scale(float(g.abs().max()) if g.numel() else 0.0)
        for s in range(0, len(targets), chunk):
            h_c, t, gr = h[s:s + chunk], targets[s:s + chunk], g[s:s + chunk]
            z = _logits(h_c, weight, softcap, temperature)
            gz = torch.softmax(z, -1).mul_(-gr[:, None])  # d (sum gr x log p(t)) / dz = gr x (onehot(t) - softmax)
            gz[torch.arange(len(t), device=t.device), t] += gr
            if temperature != 1.0:
                gz.div_(temperature)  # through z / temperature
                z.mul_(temperature)
            if softcap:
                gz.mul_(1 - (z / softcap) ** 2)  # through softcap x tanh(z / softcap)
            del z
            if grad_h is not None:
                grad_h[s:s + chunk] = ((gz * scale).to(weight.dtype) @ weight).float().div_(scale)
            if grad_w is not None:
                grad_w.addmm_(gz.t(), h_c.float())
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        reported = tuple(t.detach() for t in reported)
        ctx.mark_non_differentiable(logps, *reported)
        return (loss.detach(), logps, *reported)

    @staticmethod
    def backward(ctx, g_loss, *_):
        # in place: a second fp32 copy of lm_head's gradient (2.1 GB at 8B) would sit beside the saved one while
        # ZeRO-3 gathers the head for the body's backward. Backward runs once per forward (no retain_graph).
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        out_h = None if grad_h is None else grad_h.mul_(g_loss).to(h_dtype)
        out_w = None if grad_w is None else grad_w.mul_(g_loss).to(w_dtype)
        return out_h, out_w, None, None, None, None, None


def _grad_scale(g_max: float) -> float:
    """The power of two (at most GRAD_SCALE) that keeps g_max x scale within FP16_ROOM."""
    import math

    if not g_max > 0 or not math.isfinite(g_max):
        return GRAD_SCALE
    return min(GRAD_SCALE, 2.0 ** math.floor(math.log2(FP16_ROOM / g_max)))


def dpo_loss_fn(beta: float, loss_type: str, label_smoothing: float = 0.0, nll_alpha: float = 0.0):
    """(per-row log-probs of the policy, of the reference, per-row label-token counts) -> (loss, per-row rewards),
    rows = [chosen..., rejected...]: liger-kernel's formula (module docstring).

    nll_alpha > 0 adds the chosen completions' mean token NLL, as Liger's `alpha x chosen_nll_loss` (liger_kernel
    0.8.5 fused_linear_preference.py:428-431, 466: the sum of the chosen tokens' -log p over their number in the batch)
    and TRL's rpo_alpha (RPO, Pang et al. 2024). Why: chosen and rejected completions that differ in a few tokens share
    the rest, and DPO alone can lower those shared tokens' likelihood too (measured on smollm2_dpo: answers dropped a
    field). The term is linear in the per-row log-probs, so the fused gradient path carries it unchanged."""
    from liger_kernel.chunked_loss.dpo_loss import LigerFusedLinearDPOFunction

    def fn(logps, ref, tokens):
        m = logps.numel() // 2
        loss, chosen_rewards, rejected_rewards = LigerFusedLinearDPOFunction.preference_loss_fn(
            logps[:m], logps[m:], logps,  # full_target: only its length is read (n_pairs = len // 2)
            ref_chosen_logps=ref[:m], ref_rejected_logps=ref[m:], beta=beta, loss_type=loss_type,
            label_smoothing=label_smoothing)
        if nll_alpha:
            loss = loss + nll_alpha * -logps[:m].sum() / tokens[:m].sum().clamp(min=1)
        return loss, torch.cat([chosen_rewards, rejected_rewards])

    return fn


def per_row(loss_fn, ref, rows, n_rows: int):
    """DPO's loss_fn(per-row log-probs, ref, per-row token counts) as FusedTokenLoss takes it: on per-token log-probs,
    each row's the sum of its tokens'; reports (per-row log-probs, per-row rewards)."""
    tokens = torch.bincount(rows, minlength=n_rows)

    def fn(x):
        logps = torch.zeros(n_rows, dtype=x.dtype, device=x.device).index_add(0, rows, x)
        loss, rewards = loss_fn(logps, ref, tokens)
        return loss, (logps, rewards)

    return fn


def pair_forward(model, input_ids, position_ids, labels, ref_logps=None, loss_fn=None, chunk: int = 1024):
    """The decoder, then the completions' log-probs (ref_logps None: no grad, e.g. the reference pass) or the DPO loss.
    Runs inside the top module's forward (attach), where ZeRO-3 gathered lm_head's weight. The rows are right-padded
    and carry no mask (objective.collate): the causal path keeps every real token from the pads after it."""
    body = getattr(model, model.base_model_prefix)
    hidden = body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    rows, pos, targets = label_positions(labels)
    weight = model.get_output_embeddings().weight
    softcap = getattr(model.config, "final_logit_softcapping", None)
    n_rows = input_ids.shape[0]
    if ref_logps is None:
        return {"logps": sequence_logps(hidden[rows, pos].detach(), weight, targets, rows, n_rows, chunk, softcap)}
    loss, _, logps, rewards = FusedTokenLoss.apply(hidden[rows, pos], weight, targets,
                                                   per_row(loss_fn, ref_logps.float(), rows, n_rows), chunk, softcap)
    return {"loss": loss, "logps": logps, "rewards": rewards}


def attach(model, loss_fn, chunk: int) -> None:
    """model(..., pair_logps=True) returns the completions' log-probs, model(..., ref_logps=...) DPO's loss; every other
    call (generation, validation of SFT rows, the save's probe) goes to the model's own forward."""
    def route(kw, pair_logps: bool = False, ref_logps=None):
        if not pair_logps and ref_logps is None:
            return None
        return pair_forward(model, kw["input_ids"], kw.get("position_ids"), kw["labels"], ref_logps, loss_fn, chunk)

    attach_forward(model, {"pair_logps": False, "ref_logps": None}, route)


def attach_forward(model, extra: dict, route) -> None:
    """Give the model's forward the keyword arguments `extra` (name: default): route(kw, **those) answers a call
    that uses them (e.g. with DPO's or GRPO's loss) or returns None, and the model's own forward takes it. On the
    instance, not the class: the Trainer's DeepSpeed engine calls the module, so this runs inside its forward and
    its hooks (ZeRO-3 has lm_head gathered)."""
    import functools
    import inspect

    own = model.forward

    @functools.wraps(own)
    def forward(*args, **kw):
        mine = {k: kw.pop(k) for k in extra if k in kw}
        out = route(kw, **mine) if mine else None
        return own(*args, **kw) if out is None else out

    # generate() reads the forward's signature (transformers generation/utils.py: logits_to_keep, position ids from
    # the mask for left-padded prompts): it must see the model's own parameters, with the added ones
    sig = inspect.signature(own)
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in extra.items()]
    var_kw = [p for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD]
    forward.__signature__ = sig.replace(parameters=params + added + var_kw)
    model.forward = forward
