"""Rollouts on the training ranks: G sampled completions per prompt, and the rows GRPO's loss trains on.

Where the prompts come from: the prepared training rows (`make data`, any chat format, packing off; prompts.py).

How they are sampled: one left-padded generate() call per micro-batch (m prompts x G rows, prompt-major), as
answering.py batches greedy answers, at rl.temperature / rl.top_p and no top-k or repetition
penalty from the model's generation_config (the loss's log-probs are of softmax(logits / temperature): anything
else would sample from another distribution than the one trained). Each row draws from its own generator, seeded
from (the run's seed, the optimizer step, the prompt, the row's place in its group) (RowSampler, row_seeds): a run
resumed at a step boundary, on this world size or another, samples the same completions it would have, and the
Trainer's own RNG stream is untouched. The model is in eval mode for it (gradient
checkpointing turns the KV cache off in training mode). Under ZeRO-3 the weights are gathered once for the whole
call where every rank has room (gathering.py whole_model), else per layer per token (synced_gpus).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TopPLogitsWarper

from ..gathering import whole_model
from ..preference.loss import IGNORE


# Settings generate() would otherwise take from the model's generation_config (transformers 5.23 fills every field
# left None from it, generation/utils.py:2107-2109) whose processors run in greedy decoding too and reshape the
# distribution the loss assumes sampled (repetition penalty :1466, no-repeat n-grams :1482, a minimum length that
# suppresses the end of turn). Set to what does nothing. The sampling warpers (temperature, top-k/p, min-p, typical,
# epsilon, eta: :1597-1640) run only under do_sample, which RowSampler replaces.
NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
           "min_new_tokens": 0}  # min_new_tokens wins over min_length
# The sampling fields at the values GenerationConfig.validate does not flag in greedy mode
# (generation/configuration_utils.py:713-762), so a model whose generation_config samples (Llama-3.1-Instruct:
# temperature 0.6, top-p 0.9) does not print "generation flags are not valid" on every rollout
UNSAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def row_seeds(base: int, step: int, prompts: list[list[int]], group_size: int) -> list[int]:
    """One seed per row: (the run's seed, the optimizer step, the prompt's tokens, the row's place in its group).
    Nothing of where the prompt landed (rank, micro-step, its neighbours in the batch) enters it, so another world
    size or micro-batch samples the same completions. The same prompt twice in one step samples the same group."""
    out = []
    for p in prompts:
        key = int.from_bytes(hashlib.blake2b(repr(p).encode(), digest_size=8).digest(), "little")
        out += [(base * 1_000_003 + step * 10_007 + key * 101 + g) % (2 ** 62) for g in range(group_size)]
    return out


class RowSampler(LogitsProcessor):
    """Sampling from softmax(logits / temperature) (top-p: transformers' own warper first) as the greedy choice over
    Gumbel-perturbed scores: argmax(s + g) with g ~ Gumbel(0, 1) i.i.d. is a draw from softmax(s) (the Gumbel-max
    trick). Each row draws its noise from its own generator, one vector per step, so a row's completion depends on
    its seed and its own logits only, not on the other rows of the call, as generate()'s one multinomial over the
    batch would (transformers 5.23 generation/utils.py:3273-3276). Only: in fp16 on a GPU another batch (other
    padding, other matrix shapes) changes the logits' low bits, which can flip a near tie."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p=top_p) if top_p < 1.0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float() / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device) for g in self.generators])
        # CUDA's uniform can return 0 (curand's 1.0 mapped to it): clamped, or a one-token nucleus would be -inf too
        return scores - torch.log(-torch.log(u.clamp_min_(torch.finfo(u.dtype).tiny)))


@dataclass
class Rollouts:
    """A micro-batch's rollouts: prompt-major rows (prompt i's G completions at rows i*G .. i*G + G - 1)."""
    input_ids: torch.Tensor     # (rows, width) prompt + completion, right-padded
    position_ids: torch.Tensor
    labels: torch.Tensor        # the completion's tokens (its stop token included), IGNORE elsewhere
    completions: list[list[int]]  # each row's sampled tokens, up to and including the first stop token
    truncated: list[bool]       # no stop token within the budget


def sample(model, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float, top_p: float,
           stop: list[int], seeds: list[int], device, synced_gpus: bool = False) -> tuple[list[list[int]], list[bool]]:
    """G completions per prompt, row i drawn with seeds[i] (row_seeds): (tokens up to and including the first stop
    token, truncated) per row."""
    rows = [p for p in prompts for _ in range(group_size)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[stop[0]] * (width - len(p)) + p for p in rows], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    # greedy over RowSampler's perturbed scores is the sampling; generate()'s own warpers stay off (do_sample=False)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=stop[0],
                              use_cache=True, **NEUTRAL, **UNSAMPLED)
    sampler = LogitsProcessorList([RowSampler(seeds, temperature, top_p, torch.device(device))])
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 logits_processor=sampler, synced_gpus=synced_gpus)
    finally:
        model.train(training)
    out, truncated = [], []
    for new in gen[:, width:].tolist():
        end = next((k + 1 for k, t in enumerate(new) if t in stop), None)
        out.append(new[:end] if end is not None else new)
        truncated.append(end is None)
    return out, truncated


def rows_of(prompts: list[list[int]], completions: list[list[int]], group_size: int, pad_id: int) -> dict:
    """The training rows of a micro-batch's rollouts: prompt + completion, right-padded (no mask: the causal path
    keeps every real token from the pads after it, as DPO's rows), labels on the completion."""
    seqs = [(p, c) for i, p in enumerate(prompts) for c in completions[i * group_size:(i + 1) * group_size]]
    n = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), n), IGNORE, dtype=torch.long)
    for r, (p, c) in enumerate(seqs):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c)
        labels[r, len(p):len(p) + len(c)] = torch.tensor(c)
    return {"input_ids": ids, "position_ids": torch.arange(n).repeat(len(seqs), 1), "labels": labels}


def gathered(engine, device, sharded: bool, phase):
    """The whole model gathered once for a rollout where ZeRO-3 shards it and every rank has room (yields True),
    else nothing (yields False: generate gathers per layer, synced over ranks). phase: the plan's rollout phase."""
    if not sharded:
        return contextlib.nullcontext(False)
    return whole_model(engine, device, phase)
