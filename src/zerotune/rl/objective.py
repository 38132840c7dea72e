"""What the training worker does differently for GRPO, as one object with DPO's shape (preference/objective.py):
`for_recipe(r)` returns an `Objective`, or None when the recipe does not train by GRPO.

    collate          a micro-batch of m prepared rows -> their prompts and reference answers (prompts.split_row)
    attach(model)    the model's forward answers rollout batches with GRPO's fused loss (loss.attach)
    trainer_class    GrpoTrainer: per micro-batch, rollouts (G completions per prompt, rollout.py), their rewards
                     and advantages (rewards.py), then the loss on them; the Trainer divides by grad-accum and
                     DeepSpeed averages over ranks: the step's mean over its completions
    callbacks(...)   none
    reference        rl.beta > 0: the starting model, whose per-token log-probs of each micro-batch's rollouts enter
                     the loss's KL term: with LoRA the policy with its adapters off (no copy), else a frozen copy
                     on every rank outside ZeRO (replicated_model)
    validate         None: validation is SFT's loss on the eval split's reference answers

Nothing else of the Trainer changes: DeepSpeed, the schedule, checkpoints, signals and resume are the Trainer's and
zerotune's callbacks', as for SFT. A resumed run samples what it would have, on any world size (rollout.py: each row
is seeded by the step, its prompt and its place in the group).
"""

from __future__ import annotations

import os
import time

import torch
from transformers import AutoModelForCausalLM, Trainer
from transformers.integrations import deepspeed as hf_deepspeed
from transformers.integrations import is_deepspeed_zero3_enabled

from ..chat_template import stop_ids
from ..config import Recipe
from ..data.cache import load_tokenizer
from ..families import answer_text, of_config
from ..gathering import planned
from ..hub import local_folder
from .. import manifest as mf
from ..layout import layout
from ..metrics import dist_if_initialized
from . import loss as lossmod
from . import rollout
from .prompts import split_row
from .rewards import Rewards, group_advantages

# the sums a rank keeps between two logged steps (record, log_values)
SUMS = ("completions", "reward", "reward_sq", "groups", "zero_std_groups", "skipped_groups", "completion_tokens",
        "truncated", "clipped_tokens", "kl_tokens", "rollout_s")


def for_recipe(r: Recipe, pad_id: int) -> Objective | None:
    return Objective(r, pad_id) if r.grpo else None


class Objective:
    validate = None  # validation: SFT's loss on the eval split's reference answers (train/validation.py)

    def __init__(self, r: Recipe, pad_id: int):
        self.r = r
        self.rl = r.rl
        self.pad_id = pad_id
        self.rewards = Rewards(r.rl)  # a dotted path is imported here: a typo stops the run before the model loads
        self.tok = load_tokenizer(r)
        self.stop = stop_ids(self.tok, local_folder(str(layout(r).base)))
        self.header = _generation_header(self.tok)
        self._sums = None
        self.reference = None  # attach() loads it where rl.beta > 0
        self._planned = None  # the launch plan's rollout phase: whether a rollout gathers the model once

    def describe(self) -> str:
        rl = self.rl
        return (f"GRPO: {rl.group_size} completions per prompt (temperature {rl.temperature:g}"
                + (f", top-p {rl.top_p:g}" if rl.top_p < 1 else "") + f", at most {rl.max_new_tokens} tokens), "
                f"rewarded by {rl.reward}, advantages "
                + ("normalised by the group's std" if rl.scale_rewards else "minus the group's mean (Dr. GRPO)")
                + f"; loss {rl.loss}, clip {rl.epsilon:g}, "
                + (f"KL to the starting model x {rl.beta:g} ("
                   + ("the base with the adapters off" if self.r.peft.method != "none" else "a frozen copy on each rank")
                   + ")" if rl.beta > 0 else "no KL (beta 0)")
                + f"; rolled out on the training ranks, the loss fused over {rl.chunk_tokens}-token chunks of the "
                  "completions")

    # -- data -----------------------------------------------------------------------------------------------
    def collate(self, rows: list[dict]) -> dict:
        prompts, references = zip(*(split_row(row["input_ids"], row["labels"]) for row in rows))
        return {"prompts": [list(p) for p in prompts],
                "references": [self.tok.decode(ref, skip_special_tokens=True).strip() for ref in references]}

    # -- the model and the Trainer --------------------------------------------------------------------------
    def attach(self, model) -> None:
        rl = self.rl

        def loss_fn_of(rows, n_rows, advantages, ref_logps=None):
            return lossmod.grpo_loss_fn(rows, n_rows, advantages, loss_type=rl.loss, epsilon=rl.epsilon,
                                        max_new_tokens=rl.max_new_tokens, ref_logps=ref_logps, beta=rl.beta)

        lossmod.attach(model, loss_fn_of, rl.chunk_tokens, rl.temperature)
        if rl.beta > 0 and self.r.peft.method == "none":
            self.reference = replicated_model(layout(self.r).base, model)

    def reference_logps(self, policy, rows: dict, device):
        """The starting model's per-token log-probs of a micro-batch's completions (the KL term's), no grad: LoRA's
        base is the policy with its adapters off (under ZeRO-3 a forward through the module, as validation's, which
        every rank runs at once), full fine-tuning's the frozen copy."""
        ids, pos, labels = rows["input_ids"], rows["position_ids"], rows["labels"]
        with torch.no_grad():
            if self.reference is None:
                with policy.disable_adapter():
                    return policy(input_ids=ids, position_ids=pos, labels=labels, grpo_logps=True)["logps"]
            return lossmod.rollout_forward(self.reference, ids, pos, labels, None, None, self.rl.chunk_tokens,
                                           self.rl.temperature)["logps"]

    @property
    def trainer_class(self):
        return GrpoTrainer

    def callbacks(self, run, stop=None) -> list:
        return []

    def rollouts(self, model, engine, batch: dict, step: int, micro: int, rank: int, device, sharded: bool) -> dict:
        """The micro-batch's rollouts as training rows, with each row's advantage, and what the log reports."""
        rl = self.rl
        prompts, references = batch["prompts"], batch["references"]
        budget = min(rl.max_new_tokens, self.r.data.seq_len - max(len(p) for p in prompts))
        t0 = time.perf_counter()
        if sharded and self._planned is None:
            self._planned = planned(self.r, "rollout")
        with rollout.gathered(engine, device, sharded, self._planned) as whole:
            completions, truncated = rollout.sample(
                model, prompts, rl.group_size, budget, rl.temperature, rl.top_p, self.stop,
                rollout.row_seeds(self.r.train.seed, step, prompts, rl.group_size), device,
                synced_gpus=sharded and not whole)
        seconds = time.perf_counter() - t0
        family = of_config(model.config)
        texts = [answer_text(family, self.tok.decode(c, skip_special_tokens=True).strip()) for c in completions]
        asked = [self.prompt_text(p) for p in prompts]
        rows = [{"prompt": asked[i // rl.group_size], "answer": references[i // rl.group_size]}
                for i in range(len(texts))]
        values = self.rewards.of(texts, rows)
        rewards = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
        advantages, zero_std = group_advantages(rewards, rl.group_size, rl.scale_rewards)
        batch_rows = rollout.rows_of(prompts, completions, rl.group_size, self.pad_id)
        kept = rewards[~torch.isnan(rewards)]
        groups = len(prompts)
        skipped = int(torch.isnan(rewards.view(groups, -1)).any(-1).sum())
        if rank == 0 and micro == 0:  # what the model wrote and what it earned: one group per step, to read
            g = rl.group_size
            mf.append_jsonl(layout(self.r).rollouts, {
                "step": step + 1, "prompt": asked[0], "reference": references[0],
                "completions": [{"text": texts[i], "reward": values[i], "advantage": round(float(advantages[i]), 4)}
                                for i in range(g)]})
        self._add(completions=len(kept), reward=float(kept.sum()), reward_sq=float((kept ** 2).sum()), groups=groups,
                  zero_std_groups=zero_std, skipped_groups=skipped,
                  completion_tokens=sum(len(c) for c in completions), truncated=sum(truncated), rollout_s=seconds)
        out = {**{k: v.to(device) for k, v in batch_rows.items()}, "grpo_advantages": advantages.to(device)}
        if rl.beta > 0:
            out["grpo_ref_logps"] = self.reference_logps(model, out, device)
        return out

    def prompt_text(self, prompt: list[int]) -> str:
        """The conversation a prompt holds, as text for the reward (special tokens and the generation header off)."""
        n = len(self.header)
        if n and prompt[-n:] == self.header:
            prompt = prompt[:-n]
        return self.tok.decode(prompt, skip_special_tokens=True).strip()

    # -- metrics --------------------------------------------------------------------------------------------
    def _add(self, **values) -> None:
        s = torch.tensor([float(values.get(k, 0.0)) for k in SUMS], dtype=torch.float64)
        self._sums = s if self._sums is None else self._sums + s

    def record(self, out) -> None:
        tokens = len(out["rows"])
        self._add(clipped_tokens=float(out["clip_fraction"]) * tokens, kl_tokens=float(out.get("kl", 0.0)) * tokens)

    def log_values(self, device) -> dict:
        """The rollouts' statistics since the last log, over all ranks (every rank logs the same step: a collective)."""
        s = self._sums if self._sums is not None else torch.zeros(len(SUMS), dtype=torch.float64)
        self._sums = None
        s = s.to(device)
        d = dist_if_initialized()
        if d:
            d.all_reduce(s)
        v = dict(zip(SUMS, s.tolist()))
        if not v["groups"]:
            return {}
        n, world = max(1.0, v["completions"]), d.get_world_size() if d else 1
        mean = v["reward"] / n
        rows = max(1.0, v["groups"] * self.rl.group_size)
        out = {"rl/reward": mean, "rl/reward_std": max(0.0, v["reward_sq"] / n - mean ** 2) ** 0.5,
               "rl/zero_std_groups": v["zero_std_groups"] / v["groups"],
               "rl/completion_tokens": v["completion_tokens"] / rows, "rl/truncated": v["truncated"] / rows,
               "rl/clip_fraction": v["clipped_tokens"] / max(1.0, v["completion_tokens"]),
               "rl/rollout_s": v["rollout_s"] / world}  # each rank's rollout seconds in the step, averaged
        if self.rl.beta > 0:
            out["rl/kl"] = v["kl_tokens"] / max(1.0, v["completion_tokens"])
        if self.rl.on_reward_error == "skip":
            out["rl/skipped_groups"] = v["skipped_groups"]
        return out


class GrpoTrainer(Trainer):
    """HF Trainer whose micro-batch is rolled out, rewarded and then trained on (objective.py docstring)."""

    def __init__(self, *args, objective: Objective, **kw):
        super().__init__(*args, **kw)
        self.objective = objective
        # the loss is a mean over each micro-batch's completions: the Trainer divides it by grad-accum
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        self._at = (-1, 0)  # (optimizer step, micro-steps taken in it): the rollouts' seed

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        step = self.state.global_step
        if self._at[0] < 0 and self.args.process_index == 0:  # this attempt's first: a resumed run's later rows go
            mf.rewind_jsonl(layout(self.objective.r).rollouts, step)
        micro = self._at[1] if self._at[0] == step else 0
        self._at = (step, micro + 1)
        rows = self.objective.rollouts(self.model, self.model_wrapped, inputs, step, micro, self.args.process_index,
                                       self.args.device, bool(dist_if_initialized()) and is_deepspeed_zero3_enabled())
        out = model(**rows)
        self.objective.record(out)
        return (out["loss"], out) if return_outputs else out["loss"]

    def log(self, logs: dict, *args, **kw) -> None:
        if "loss" in logs:  # a training step's log (all ranks call it together)
            logs = {**logs, **self.objective.log_values(self.args.device)}
        super().log(logs, *args, **kw)


def replicated_model(path, policy):
    """The starting model as a frozen copy on this rank, in the policy's dtype and attention: loaded outside ZeRO-3
    (transformers partitions every from_pretrained while the Trainer's DeepSpeed config is registered: the copy
    would have no engine to gather it), so each rank holds it whole (the plan counts it: planner/phases.py)."""
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    registered = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=policy.dtype,
                                                     attn_implementation=policy.config._attn_implementation)
    finally:
        if registered is not None:
            hf_deepspeed.set_hf_deepspeed_config(registered)
    model.config.use_cache = False
    # onto this rank's GPU now, not at the first rollout: the host would hold every rank's copy until then (8 x 16 GB
    # at 8B), and the first gather-once decision (gathering.room_to_gather) would see the GPU without it
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    return model.to(device).eval().requires_grad_(False)


def _generation_header(tok) -> list[int]:
    """The tokens the chat template adds for add_generation_prompt (Llama 3's assistant header, ChatML's
    <|im_start|>assistant): what a prompt ends with and its text for the reward should not."""
    msgs = [{"role": "user", "content": "x"}]
    with_header, without = (list(tok.apply_chat_template(msgs, add_generation_prompt=g, tokenize=True,
                                                         return_dict=True)["input_ids"]) for g in (True, False))
    return with_header[len(without):] if with_header[:len(without)] == without else []
