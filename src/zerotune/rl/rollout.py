"""Rollouts on the training ranks: G sampled completions per prompt, and the rows GRPO's loss trains on.

Where the prompts come from: the prepared training rows (`make data`, any chat format, packing off). A row's prompt is
its tokens before its last assistant turn's labels (the chat template's generation header included: the tokens
add_generation_prompt would give), its reference the text of that turn (`split_row`). So a user's SFT data is GRPO
data as it is, and the reward compares a completion with what the data says is right.

How they are sampled: one left-padded generate() call per micro-batch (m prompts x G rows, prompt-major), as
answering.py batches greedy answers, with do_sample at rl.temperature / rl.top_p and no top-k or repetition
penalty from the model's generation_config (the loss's log-probs are of softmax(logits / temperature): anything
else would sample from another distribution than the one trained). The RNG is forked and seeded from (the run's
seed, the optimizer step, the micro-step, the rank): a run resumed at a step boundary samples the same completions
it would have, and the Trainer's own RNG stream is untouched. The model is in eval mode for it (gradient
checkpointing turns the KV cache off in training mode). Under ZeRO-3 the weights are gathered once for the whole
call where every rank has room (gathering.py whole_model), else per layer per token (synced_gpus).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ..gathering import whole_model
from ..preference.loss import IGNORE


def split_row(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, reference ids) of a prepared row: the prompt ends where its last run of label tokens starts."""
    end = max((i for i, t in enumerate(labels) if t != IGNORE), default=None)
    if end is None:
        return list(input_ids), []
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return list(input_ids[:start]), list(input_ids[start:end + 1])


# Sampling settings generate() would otherwise take from the model's generation_config (transformers 5.23 fills every
# field left None from it, generation/utils.py:2107-2109): each reshapes the distribution the loss assumes sampled
# (repetition penalty :1466, no-repeat n-grams :1482, min-p / typical / epsilon / eta warpers :1624-1639, a minimum
# length that suppresses the end of turn). Set to what does nothing.
NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_p": 0.0, "typical_p": 1.0,
           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_new_tokens": 0}  # min_new_tokens wins over min_length


def seed_of(base: int, step: int, micro: int, rank: int) -> int:
    return (base * 1_000_003 + step * 10_007 + micro * 101 + rank) % (2 ** 62)


@dataclass
class Rollouts:
    """A micro-batch's rollouts: prompt-major rows (prompt i's G completions at rows i*G .. i*G + G - 1)."""
    input_ids: torch.Tensor     # (rows, width) prompt + completion, right-padded
    position_ids: torch.Tensor
    labels: torch.Tensor        # the completion's tokens (its stop token included), IGNORE elsewhere
    completions: list[list[int]]  # each row's sampled tokens, up to and including the first stop token
    truncated: list[bool]       # no stop token within the budget


def sample(model, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float, top_p: float,
           stop: list[int], seed: int, device, synced_gpus: bool = False) -> tuple[list[list[int]], list[bool]]:
    """G completions per prompt: (tokens up to and including the first stop token, truncated) per row."""
    rows = [p for p in prompts for _ in range(group_size)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[stop[0]] * (width - len(p)) + p for p in rows], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    config = GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
                              eos_token_id=stop, pad_token_id=stop[0], use_cache=True, **NEUTRAL)
    training = model.training
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, synced_gpus=synced_gpus)
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
