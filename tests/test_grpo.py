"""GRPO (rl.method: grpo): the fused loss against Liger's and against the formula on full logits, the rewards (scorers,
a user's function, its time limit and errors), group advantages, the recipe's rules, and the run itself on the tiny
model under ZeRO-3 (tiny_grpo)."""

from __future__ import annotations

import pytest

from conftest import REPO, tiny_random_model


def _rollout_batch():
    """2 prompts x G 2 = 4 rows as rollout.py builds them: prompt, completion (labels), right pads."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 12), generator=g)
    labels = torch.full_like(ids, -100)
    for row, (p, c) in enumerate(((5, 7), (5, 4), (3, 6), (3, 9))):  # prompt length, completion length
        labels[row, p:p + c] = ids[row, p:p + c]
    return ids, labels, torch.tensor([1.2, -1.2, 0.7, -0.7])


def _grid(labels):
    """(rows, T) of each completion-predicting position (HF's shift) and its mask."""
    import torch

    nxt = labels[:, 1:]
    T = int((nxt != -100).sum(-1).max())
    pos = torch.zeros(labels.shape[0], T, dtype=torch.long)
    mask = torch.zeros(labels.shape[0], T)
    for r in range(labels.shape[0]):
        p = (nxt[r] != -100).nonzero()[:, 0]
        pos[r, :len(p)], mask[r, :len(p)] = p, 1
    return pos, mask


@pytest.mark.parametrize("loss_type,temperature,off_policy,beta", [
    ("grpo", 1.0, False, 0.0), ("dr_grpo", 1.0, False, 0.0), ("grpo", 0.7, True, 0.0), ("grpo", 0.7, False, 0.0),
    ("grpo", 1.0, True, 0.0), ("grpo", 1.0, False, 0.04), ("dr_grpo", 0.7, True, 0.1)])
def test_fused_grpo_loss_equals_ligers_fused_loss_and_the_formula(loss_type, temperature, off_policy, beta):
    """zerotune's fused GRPO loss (3 label tokens' logits at a time, gradients in forward) against (1) the formula
    written out on the full logits (log_softmax / temperature, the clipped ratio, the KL's k3 estimator, each
    normalisation) and (2) Liger's LigerFusedLinearGRPOLoss on the same hidden states: the loss, the KL and every
    parameter's gradient. off_policy: the rollout policy's log-probs differ from the policy's by up to +-0.5, so some
    ratios clip; beta > 0: the starting model's log-probs differ from the policy's by up to +-0.3."""
    import torch

    from zerotune.rl.loss import attach, grpo_loss_fn

    model, eps, max_new = tiny_random_model(), 0.2, 10
    ids, labels, adv = _rollout_batch()
    pos, mask = _grid(labels)
    old = None
    if off_policy:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float() / temperature, -1)
            lp = lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        noise = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(2)) - 0.5)
        old_grid = lp.gather(1, pos) + noise.gather(1, pos)
        old = old_grid[mask.bool()]  # flat, row by row: label_positions' order

    ref = ref_grid = None
    if beta:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float() / temperature, -1)
            lp = lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
        noise = 0.6 * (torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)) - 0.5)
        ref_grid = lp.gather(1, pos) + noise.gather(1, pos)
        ref = ref_grid[mask.bool()]

    def loss_fn_of(rows, n_rows, a, ref_logps=None):
        return grpo_loss_fn(rows, n_rows, a, loss_type=loss_type, epsilon=eps, max_new_tokens=max_new, old_logps=old,
                            ref_logps=ref_logps, beta=beta)

    attach(model, loss_fn_of, chunk=3, temperature=temperature)
    out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).repeat(4, 1), labels=labels,
                grpo_advantages=adv, **({"grpo_ref_logps": ref} if beta else {}))
    out["loss"].backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # (1) the formula on full logits
    lp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float() / temperature, -1)
    P = lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0].gather(1, pos)
    ratio = torch.exp(P - (P.detach() if old is None else old_grid))
    per_token = -torch.min(ratio * adv[:, None], ratio.clamp(1 - eps, 1 + eps) * adv[:, None])
    if beta:
        kl = torch.exp(ref_grid - P) - (ref_grid - P) - 1
        per_token = per_token + beta * kl
        assert out["kl"].item() == pytest.approx(float((kl * mask).sum() / mask.sum()), rel=1e-5)
        assert out["kl"].item() > 1e-3
    else:
        assert "kl" not in out
    want = (((per_token * mask).sum(-1) / mask.sum(-1)).mean() if loss_type == "grpo" else
            (per_token * mask).sum() / (4 * max_new))
    want.backward()
    assert out["loss"].item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.allclose(out["logps"], P[mask.bool()].detach(), atol=1e-5)
    clipped = ((ratio < 1 - eps) & (adv[:, None] < 0)) | ((ratio > 1 + eps) & (adv[:, None] > 0))
    assert out["clip_fraction"].item() == pytest.approx(float((clipped * mask).sum() / mask.sum()))
    assert (out["clip_fraction"].item() > 0) == off_policy
    for name, p in model.named_parameters():
        assert torch.allclose(fused[name], p.grad, rtol=1e-4, atol=1e-6 * float(p.grad.abs().max())), name
    model.zero_grad()

    # (2) Liger's whole fused loss on the completions' hidden states
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss

    hidden = model.model(input_ids=ids).last_hidden_state
    h = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
    liger = LigerFusedLinearGRPOLoss(beta=beta, compiled=False, use_ref_model=bool(beta), chunk_size=4,
                                     epsilon_low=eps, epsilon_high=eps, loss_type=loss_type,
                                     max_completion_length=max_new, temperature=temperature)
    targets = labels[:, 1:].clamp(min=0).gather(1, pos)
    loss, _ = liger(h, model.lm_head.weight, targets, mask, adv, old_per_token_logps=None if old is None else old_grid,
                    ref_per_token_logps=ref_grid)
    loss.backward()
    assert out["loss"].item() == pytest.approx(loss.item(), rel=1e-4)  # Liger: an online logsumexp over vocab chunks
    for name, p in model.named_parameters():
        assert torch.allclose(fused[name], p.grad, rtol=1e-4, atol=1e-7), name


def test_the_kl_term_of_a_token_far_from_the_start_is_bounded():
    """k3's gradient per token, beta x (1 - exp(ref - logp)), has no bound: one token at ref - logp = 30 would be
    1e13 x beta and set the fused loss's fp16 scale for the whole micro-batch. grpo_loss_fn clamps the log-ratio at
    KL_LOG_RATIO: that token's gradient is beta x (1 - e^10), the others' are the formula's, untouched."""
    import math

    import torch

    from zerotune.rl.loss import KL_LOG_RATIO, grpo_loss_fn

    rows = torch.tensor([0, 0, 0, 1, 1])
    logps = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], requires_grad=True)
    ref = logps.detach() + torch.tensor([0.1, -0.2, 30.0, 0.0, -25.0])
    adv, beta = torch.tensor([0.0, 0.0]), 0.04  # no advantage: the KL's gradient alone
    loss, (clip, kl) = grpo_loss_fn(rows, 2, adv, loss_type="dr_grpo", epsilon=0.2, max_new_tokens=3,
                                    ref_logps=ref, beta=beta)(logps)
    loss.backward()
    d = torch.tensor([0.1, -0.2, KL_LOG_RATIO, 0.0, -KL_LOG_RATIO])  # ref - logp, clamped
    want = beta * (1 - torch.exp(d)) / (2 * 3)  # dr_grpo: / (rows x max_new_tokens)
    assert torch.allclose(logps.grad, want, rtol=1e-5) and math.isfinite(float(loss))
    assert kl.item() == pytest.approx(float((torch.exp(d) - d - 1).mean()), rel=1e-5)


# ---- rewards and advantages ----------------------------------------------------------------------------------------

def _rewards(reward: str, **rl):
    from zerotune.config import RlCfg
    from zerotune.rl.rewards import Rewards

    return Rewards(RlCfg(method="grpo", reward=reward, **rl))


ROW = {"prompt": "<|system|>Extract the record.<|user|>Ada is 36 and lives in Leiden.<|assistant|>",
       "answer": '{"name": "Ada", "age": 36, "city": "Leiden"}'}


def test_a_scorer_or_a_users_function_by_dotted_path_is_the_reward():
    assert _rewards("json_fields").of(['{"name": "Ada", "age": 36, "city": "Leiden"}', "{}"], [ROW, ROW]) == [1.0, 0.0]
    partial = _rewards("json_field_share").of(['{"name": "Ada", "age": 36, "city": "Lisbon"}'], [ROW])
    assert partial == [pytest.approx(2 / 3)]
    assert _rewards("grpo_rewards.length").of(["abcd"], [ROW]) == [4.0]
    assert _rewards("recipes.rewards.letters").of(["ab 1"], [ROW]) == [0.75]


@pytest.mark.parametrize("fn,says", [("raises", "raised KeyError: 'score'"),
                                     ("sleeps", "ran past rl.reward_timeout_s=0.2 s"),
                                     ("text", "returned 'high', not a finite number")])
def test_a_reward_that_fails_is_one_line_naming_the_function_and_the_prompt_or_a_counted_skip(fn, says):
    from zerotune.errors import UserError

    with pytest.raises(UserError) as e:
        _rewards(f"grpo_rewards.{fn}", reward_timeout_s=0.2).of(["x"], [ROW])
    msg = str(e.value)
    assert f"rl.reward grpo_rewards.{fn} {says}" in msg and "\n" not in msg
    assert "lives in Leiden.<|assistant|>" in msg and "rl.on_reward_error: skip" in msg
    assert _rewards(f"grpo_rewards.{fn}", reward_timeout_s=0.2, on_reward_error="skip").of(["x"], [ROW]) == [None]


def test_a_reward_path_that_does_not_import_stops_before_the_model_loads():
    from zerotune.errors import UserError

    with pytest.raises(UserError, match=r"cannot import module 'no_such_module'"):
        _rewards("no_such_module.score")
    with pytest.raises(UserError, match=r"has no function 'nothing'"):
        _rewards("grpo_rewards.nothing")


def test_group_advantages_are_grpos_or_dr_grpos_and_a_skipped_group_teaches_nothing():
    import torch

    from zerotune.rl.rewards import group_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 1.0,  0.5, 0.5, 0.5, 0.5,  1.0, float("nan"), 0.0, 0.0])
    adv, zero_std = group_advantages(r, 4, scale=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as TRL's
    assert torch.allclose(adv[:4], (torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.5) / (std + 1e-4))
    assert adv[4:].abs().sum() == 0 and zero_std == 1  # the all-0.5 group; the skipped one is not counted as such
    adv, _ = group_advantages(r, 4, scale=False)
    assert torch.equal(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))  # Dr. GRPO: no division by the spread


# ---- the recipe and the batch --------------------------------------------------------------------------------------

def test_the_recipe_refuses_what_grpo_cannot_do(tokenizer_dir):
    from zerotune.config import RecipeError, from_dict

    chats = [{"path": "data/tiny/train.jsonl", "format": "messages"}]
    cases = [({"packing": True}, {}, "prompts are not packed"),
             ({}, {"reward": "bad path!"}, "neither a scorer"),
             ({"seq_len": 64}, {"max_new_tokens": 64}, "leaves no room for a prompt"),
             ({}, {"group_size": 1}, "rl.group_size=1: must be >= 2"),
             ({}, {"loss": "dapo"}, "rl.loss")]
    cases.append(({}, {}, "peft.method=qlora is not supported yet (tested: full fine-tuning and peft.method: lora)"))
    cases.append(({}, {}, "peft.modules_to_save=['lm_head'] with rl.method=grpo is not supported yet"))
    for data, rl, says in cases:
        raw = {"name": "t", "model": {"init_config": "configs/models/tiny_llama31.json", "tokenizer": str(tokenizer_dir)},
               "data": {"sources": chats, "packing": False, "seq_len": 128, **data}, "rl": {"method": "grpo", **rl}}
        if "qlora" in says:
            raw["peft"] = {"method": "qlora"}
            raw["train"] = {"deepspeed": None}
        elif "modules_to_save" in says:
            raw["peft"] = {"method": "lora", "modules_to_save": ["lm_head"]}
        with pytest.raises(RecipeError) as e:
            from_dict(raw)
        assert says in str(e.value), (says, str(e.value))


def test_a_prompt_counts_its_group_of_rows_in_the_global_batch():
    from zerotune.batch import BatchError, derive

    bp = derive(1024, 64, 2, 2, rows=4, grpo=True)
    assert bp.grad_accum == 1 and bp.sequences_per_step == 4 and bp.tokens_per_micro_step == 1024
    assert "4 completions x seq_len 64 x micro-batch 2 prompts" in bp.describe()
    with pytest.raises(BatchError, match=r"rl.group_size x seq_len x micro-batch \(prompts\) x world = 4 x 64 x 2 x 3"):
        derive(1024, 64, 2, 3, rows=4, grpo=True)


# ---- rollouts ------------------------------------------------------------------------------------------------------

def test_a_rows_prompt_is_everything_before_its_last_assistant_turn():
    from zerotune.rl.prompts import split_row
    from zerotune.rl.rollout import rows_of

    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    labels = [-100, -100, 3, 4, -100, -100, 7, 8, 9]  # two assistant turns: the last is the reference
    assert split_row(ids, labels) == ([1, 2, 3, 4, 5, 6], [7, 8, 9])
    rows = rows_of([[1, 2], [3]], [[10, 11], [12], [13, 14, 15], [16]], group_size=2, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 10, 11], [1, 2, 12, 0], [3, 13, 14, 15], [3, 16, 0, 0]]
    assert rows["labels"].tolist() == [[-100, -100, 10, 11], [-100, -100, 12, -100], [-100, 13, 14, 15],
                                       [-100, 16, -100, -100]]


def test_rollouts_are_seeded_per_step_and_prompt_and_leave_the_trainers_rng_alone(capfd):
    """The same seed samples the same completions (a resumed run's are the uninterrupted run's), another step others;
    a prompt's group is the same alone as beside another prompt (another batch, other left padding: another world
    size or micro-batch); the global RNG the Trainer draws from is where it was; the model goes back to training
    mode; a repetition penalty in the model's generation_config changes nothing (the loss assumes
    softmax(logits / T)); every completion ends at its first stop token or runs the whole budget."""
    import torch

    from zerotune.rl.rollout import row_seeds, sample

    model = tiny_random_model()
    model.train()
    prompts, stop = [[5, 6, 7], [8, 9]], [2, 3]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = sample(model, prompts, 4, 6, 1.0, 1.0, stop, row_seeds(42, 3, prompts, 4), "cpu")
    assert torch.equal(torch.get_rng_state(), before) and model.training
    b = sample(model, prompts, 4, 6, 1.0, 1.0, stop, row_seeds(42, 3, prompts, 4), "cpu")
    c = sample(model, prompts, 4, 6, 1.0, 1.0, stop, row_seeds(42, 4, prompts, 4), "cpu")
    assert a == b and a[0] != c[0]
    alone = sample(model, prompts[1:], 4, 6, 1.0, 1.0, stop, row_seeds(42, 3, prompts[1:], 4), "cpu")
    assert alone[0] == a[0][4:] and alone[1] == a[1][4:]
    model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size = 10.0, 1
    # a model that samples by default (Llama-3.1-Instruct's generation_config): nothing of it, and no warning
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = True, 0.6, 0.9, 40
    capfd.readouterr()
    assert sample(model, prompts, 4, 6, 1.0, 1.0, stop, row_seeds(42, 3, prompts, 4), "cpu") == a, "its own settings"
    assert "not valid" not in "".join(capfd.readouterr()), "a warning on every rollout"
    completions, truncated = a
    assert len(completions) == 8 and len(set(map(tuple, completions))) > 1  # sampled, not greedy
    for c_, cut in zip(completions, truncated):
        assert (c_[-1] in stop) != cut and not any(t in stop for t in c_[:-1]) and len(c_) <= 6


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_each_rows_draw_is_from_the_tempered_distribution(temperature, top_p):
    """RowSampler's greedy choice over Gumbel-perturbed scores is a draw from softmax(logits / T), restricted to
    transformers' top-p nucleus: 20,000 rows with their own seeds hit each token as often as the distribution says
    (within 4 standard errors), and a token outside the nucleus never."""
    import torch
    from transformers.generation.logits_process import TopPLogitsWarper

    from zerotune.rl.rollout import RowSampler

    n, logits = 20_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sampler = RowSampler(list(range(n)), temperature, top_p, torch.device("cpu"))
    picks = sampler(None, logits.repeat(n, 1)).argmax(-1)
    want = torch.softmax(TopPLogitsWarper(top_p)(None, logits[None] / temperature) if top_p < 1
                         else logits[None] / temperature, -1)[0]
    got = torch.bincount(picks, minlength=5).double() / n
    se = (want * (1 - want) / n).sqrt()
    assert ((got - want).abs() <= 4 * se + 1e-12).all(), (got, want)
    assert (got[want == 0] == 0).all() and (want == 0).any() == (top_p < 1)


# ---- the run -------------------------------------------------------------------------------------------------------

# with the KL to the starting model: its copy on each rank is part of what a resumed run must rebuild exactly
GRPO_COMMON = ["train.max_steps=4", "train.logging_steps=1", "rl.beta=0.04"]


@pytest.mark.integration
def test_tiny_grpo_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    """tiny_grpo on 2 ZeRO-3 CPU ranks: an uninterrupted 4-step run whose rollouts gather the model per layer per
    token (the fault that finds no room for the whole model, as at 8B on a full node) against a run that starts on 1
    process, is stopped after step 1 by a deadline already passed (checkpoint-1 committed at world size 1) and
    resumes on 2 through the universal conversion, whose rollouts gather it once: every step's rollouts, rewards,
    KL, loss and gradient norm equal (each row samples from its own seed, wherever its prompt lands). With rl.beta > 0 each rank holds the starting model
    whole beside its ZeRO-3 shard (loaded outside ZeRO) and forwards every rollout with it: the KL is 0 at step 1
    (the policy is the start) and grows after. The log says what GRPO reports per step."""
    import os
    import shutil
    import time
    from pathlib import Path

    from conftest import _zt, finetune_on, read_metrics
    from zerotune.manifest import read_jsonl

    def shm_buffers():  # DeepSpeed's CPU all-reduce buffers, which the launcher removes (train/launch.py)
        return set(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))

    before = shm_buffers()
    ref, run = tmp_path / "ref", tmp_path / "run"
    _zt("data", "tiny_grpo", f"output_dir={ref}")
    log = _zt("finetune", "tiny_grpo", f"output_dir={ref}", *GRPO_COMMON,
              env={"ZEROTUNE_FAULT_NO_ROOM_TO_GATHER": "1"})
    assert "(4 prompts, 16 completions per optimizer step)" in log and "GRPO: 4 completions per prompt" in log
    assert "reward 0." in log and "groups without spread" in log and "Traceback" not in log
    assert "rollouts' mean reward" in log  # the run's summary: what moved (GRPO's loss is ~0 by construction)
    assert "KL to the starting model x 0.04 (a frozen copy on each rank)" in log and ", KL " in log
    kl = [x["rl/kl"] for x in read_metrics(ref)]
    assert kl[0] < 1e-9 and min(kl[1:]) > 1e-6, kl  # the copy is the policy's start, whole on every rank
    for part in ("data", "base"):
        shutil.copytree(ref / part, run / part)

    rc, out = finetune_on(1, "tiny_grpo", run, *GRPO_COMMON, ZEROTUNE_DEADLINE=str(int(time.time())))
    assert rc == 75 and "checkpointing at step 1 and stopping" in out, out[-3000:]
    rc, out = finetune_on(2, "tiny_grpo", run, *GRPO_COMMON)
    assert rc == 0 and "world size 1 -> 2" in out and "Traceback" not in out, out[-3000:]
    a, b = read_metrics(ref), read_metrics(run)
    assert [x["step"] for x in b] == [1, 2, 3, 4], "every step exactly once"
    for x, y in zip(a, b):
        for key in ("rl/reward", "rl/reward_std", "rl/completion_tokens", "rl/zero_std_groups"):
            assert y[key] == x[key], (key, x, y)
        assert y["rl/kl"] == pytest.approx(x["rl/kl"], rel=1e-4, abs=1e-9), (x, y)
        assert y["loss"] == pytest.approx(x["loss"], abs=5e-6), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)
    assert len({x["rl/reward"] for x in a}) > 1 and all(x["grad_norm"] > 0 for x in a), "rollouts that teach"
    # train/rollouts.jsonl, one group per step to read: the resumed run's are the reference's, each step once
    got, want = (read_jsonl(d / "train" / "rollouts.jsonl") for d in (run, ref))
    assert [x["step"] for x in got] == [1, 2, 3, 4] and got == want
    assert len(got[0]["completions"]) == 4 and {"text", "reward", "advantage"} <= set(got[0]["completions"][0])
    assert shm_buffers() <= before, "three runs (one stopped) left no 64 MiB shared-memory buffer behind"


@pytest.mark.integration
@pytest.mark.extended  # ~1 min; CI: LoRA under ZeRO-3 (test_peft.py), the KL's formula and its copy's resume (this file)
def test_lora_grpo_under_zero3_takes_its_kl_to_the_base_with_the_adapters_off(tmp_path):
    """tiny_grpo with LoRA on q and v, rl.beta 0.04, on 2 ZeRO-3 CPU ranks: the KL's reference is the policy with its
    adapters off (no copy), so the KL is 0 at step 1 (LoRA's B starts at 0) and > 0 once the adapters moved; the
    published model is the base with merged adapters: only the adapted weights differ from it."""
    import torch
    from safetensors.torch import load_file

    from conftest import _zt, read_metrics

    out = tmp_path / "run"
    _zt("data", "tiny_grpo", f"output_dir={out}")
    log = _zt("finetune", "tiny_grpo", f"output_dir={out}", "train.max_steps=3", "train.logging_steps=1",
              "rl.beta=0.04", "peft.method=lora", "peft.r=8", "peft.alpha=16", "peft.target_modules=[q_proj, v_proj]",
              "train.lr=1e-2")
    assert "KL to the starting model x 0.04 (the base with the adapters off)" in log and "Traceback" not in log
    kl = [x["rl/kl"] for x in read_metrics(out)]
    assert kl[0] == 0 and min(kl[1:]) > 1e-4, kl
    base, model = (load_file(str(next((out / d).glob("*.safetensors")))) for d in ("base", "model"))
    changed = {k for k in base if not torch.equal(base[k], model[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), sorted(changed)[:5]


@pytest.mark.integration
@pytest.mark.extended  # 1.7 min; CI: the message and the skip (this file), a worker's user error under torchrun (test_user_errors.py)
def test_a_reward_that_raises_in_the_workers_stops_the_run_in_one_line_with_exit_2(tmp_path):
    """Under torchrun: the user's reward raises at the first rollout; `zerotune finetune` prints one line naming the
    function and the prompt and exits 2, no traceback, no torchrun failure report; the prepared data stays."""
    import os
    import subprocess
    import sys

    from conftest import _zt

    _zt("data", "tiny_grpo", f"output_dir={tmp_path}")
    proc = subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny_grpo", f"output_dir={tmp_path}",
                           "rl.reward=grpo_rewards.raises", "train.max_steps=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})  # where grpo_rewards.py is
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "rl.reward grpo_rewards.raises raised KeyError" in line]
    assert len(said) == 1 and said[0].startswith("zerotune: ") and "[rank" not in proc.stderr, proc.stderr[-3000:]
    asked = said[0].split('ending "', 1)[1].split('";', 1)[0]
    assert "Repeat after me:" in asked and not asked.endswith("assistant")  # the question, no generation header
    assert "rl.on_reward_error: skip" in said[0] and "Traceback" not in proc.stderr + proc.stdout
    assert "ChildFailedError" not in proc.stderr and (tmp_path / "data").exists()


# ---- the plan ------------------------------------------------------------------------------------------------------

def test_fp16_starts_grpo_with_the_headroom_its_advantages_leave():
    """ds_config.micro_step_weight for GRPO: a micro-step weighs mean |A| / GA on its completion tokens'
    log-probs; scaled advantages' mean |A| is at most sqrt((G - 1) / G) (measured here on random rewards), so
    the initial scale is SFT's; Dr. GRPO's unscaled advantages on [0, 1] rewards weigh at most 1/2: one power more."""
    import math

    import torch

    from zerotune.config import load_recipe
    from zerotune.ds_config import loss_scale, micro_step_weight
    from zerotune.rl.rewards import group_advantages

    torch.manual_seed(0)
    for g in (2, 8, 16):
        for rewards in (torch.rand(64, g).round(), torch.rand(64, g)):  # 0/1 rewards (the scorers'), partial credit
            a, _ = group_advantages(rewards.flatten(), g, scale=True)
            spread = rewards.std(dim=1) > 0
            assert a.view(64, g)[spread].abs().mean() <= math.sqrt((g - 1) / g) + 1e-6
            assert group_advantages(rewards.flatten(), g, scale=False)[0].abs().mean() <= 0.5
    r = load_recipe("llama8b_grpo_zero3")  # Dr. GRPO: scale_rewards false
    assert micro_step_weight(r, 8) == 0.5 / 8 and loss_scale(8, 100, 0.5 / 8)[0] == loss_scale(8, 100)[0] + 1
    scaled = load_recipe("llama8b_grpo_zero3", ["rl.scale_rewards=true"])
    assert micro_step_weight(scaled, 8) == pytest.approx(math.sqrt(7 / 8) / 8)
    assert loss_scale(8, 100, micro_step_weight(scaled, 8))[0] == loss_scale(8, 100)[0]



def test_the_8b_grpo_recipe_fits_every_phase_of_a_v100_node_and_states_its_rollout_time():
    """llama8b_grpo_zero3 on one node of 8 x V100-32GB: every phase fits; the training step takes the fused loss
    (no 8 x 1,024 x 128,256 logits); the rollout phase holds a micro-step's 8 rows of KV cache beside the states and
    cannot also hold the whole 16 GB model, so it gathers per token (the host's 32 layers x 4.5 ms per decode step);
    its time per optimizer step is grad-accum x one generate(), a term of the step time every part of the plan uses
    (the headline, the node table, the preemption arithmetic). On 4 nodes the states shrink to a quarter and the
    whole model is gathered once per generate(): the rollouts get faster, and the node table's speedup says so."""
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.memory import GiB
    from zerotune.planner.report import format_plan
    from zerotune.planner.time import FIGURES

    r = load_recipe("llama8b_grpo_zero3")
    p = compute_plan(r)
    assert p.recipe_batch.fits and p.recipe_batch.grad_accum == 8
    assert [name for name, _ in p.phases.items()][:2] == ["train_step", "rollout"]
    assert all(ph.fits for _, ph in p.phases.items() if ph.runs), {k: v.peak_bytes / GiB for k, v in p.phases.items()}
    assert p.memory.parts["logits + loss"] < 4 * GiB and "no sequence x vocabulary logits" in p.memory.logits_how
    ro = p.phases.rollout
    assert not ro.gather_once and ro.time.rows == 8 and ro.time.new_tokens == 512
    assert ro.time.per_token_s == pytest.approx(32 * FIGURES["zero3_host_s_per_layer_pass"].value, rel=0.01)
    assert ro.time.seconds == pytest.approx(8 * ro.time.per_micro_step_s)
    # full fine-tuning at 8B on one node: the rollouts are most of a step, and the step counts them
    assert p.time.terms.rollout == ro.time.seconds > 0.5 * p.time.seconds_per_step
    assert p.time.seconds_per_step == pytest.approx(p.time.terms.total) and p.time.dominant == "rollout"
    assert p.preemption.lost_on_kill_s == pytest.approx(r.train.save_steps * p.time.seconds_per_step)
    text = format_plan(p)
    assert "8 generate() x 75 s: 8 completions x 512 sampled tokens each" in text
    assert "of each 12 min optimizer step (83%) samples completions" in text
    # a USR1 at another time than the limit's (a preemption's grace) waits for the step in flight, rollouts and all
    needs = p.preemption.idle_at_time_limit_s
    assert needs > p.time.terms.rollout + p.preemption.save_s > p.preemption.signal_lead_s
    assert f"the step in flight ends first, then the save: it needs {needs / 3600:.2f} h of warning" in text

    four = compute_plan(r, nodes=4)
    assert four.phases.rollout.gather_once and four.phases.rollout.fits
    assert four.phases.rollout.time.per_micro_step_s < ro.time.per_micro_step_s / 3
    # the node table's rows are the same step times: one node's rollouts per token, four nodes' gathered once
    rows = {row.nodes: row.on(p.time.cluster) for row in p.time.nodes.rows}
    assert rows[1].seconds_per_step == pytest.approx(p.time.seconds_per_step)
    assert rows[4].terms.rollout == pytest.approx(four.time.terms.rollout)
    assert rows[4].speedup > 4  # more than the GPUs: the gathers per sampled token are gone
    assert not compute_plan(load_recipe("llama8b_zero3")).time.terms.rollout


def test_the_kl_terms_reference_copy_is_planned_on_every_gpu_and_refused_where_it_does_not_fit():
    """rl.beta > 0 keeps the starting model whole on every GPU (rl/objective.py replicated_model): the plan counts it
    in every phase the training process holds it (train step, rollout, validation, samples, save, resume) and plans
    its forward of each micro-step's rollouts (the `reference` phase, and its seconds in the rollout term). At 8B on
    a V100 node its 15 GiB do not fit beside full fine-tuning's states: the plan says so and that rl.beta=0 fits."""
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.memory import REFERENCE_COPY, GiB
    from zerotune.planner.report import format_plan

    without = compute_plan(load_recipe("llama8b_grpo_zero3"))
    p = compute_plan(load_recipe("llama8b_grpo_zero3", ["rl.beta=0.04"]))
    copy = 2 * p.model.n_params
    held = {"train_step", "rollout", "reference", "validation", "samples", "save", "resume"}
    assert {n for n, ph in p.phases.items() if ph.parts.get(REFERENCE_COPY) == copy} == held
    assert without.phases.reference is None and REFERENCE_COPY not in without.memory.parts
    assert p.memory.peak_bytes - without.memory.peak_bytes >= copy and not p.recipe_batch.fits
    ro = p.phases.rollout.time
    assert 0 < ro.reference_s < ro.per_micro_step_s / 10  # a no-grad forward of the rows: small beside sampling
    text = format_plan(p)
    assert "nothing fits. Try: rl.beta=0: 29.0 GiB (fits)" in text
    assert all(o.sequence_parallel == 1 for o in p.options)  # GRPO refuses sequence parallelism: never offered
    assert {o.seq_len for o in p.options} == {1024}  # another seq_len is other work (prompts per step), not offered

    tiny = compute_plan(load_recipe("tiny_grpo", ["rl.beta=0.04"]))
    assert tiny.recipe_batch.fits and tiny.memory.parts[REFERENCE_COPY] == 4 * tiny.model.n_params  # fp32 on CPU
    assert tiny.phases.reference.fits and tiny.phases.reference.peak_bytes < 2 * GiB


def test_the_lora_8b_grpo_recipe_gathers_once_and_its_kl_reference_is_the_base_itself():
    """llama8b_grpo_lora_zero3: LoRA's states leave every rank room to gather the whole model once per generate(),
    and the KL's reference is the policy with its adapters off: no copy, its forward gathered as any ZeRO-3 forward.
    Every phase fits one V100 node and the step is a third of full fine-tuning GRPO's (llama8b_grpo_zero3)."""
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.memory import REFERENCE_COPY

    p = compute_plan(load_recipe("llama8b_grpo_lora_zero3"))
    full = compute_plan(load_recipe("llama8b_grpo_zero3"))
    assert p.recipe_batch.fits and all(ph.fits for _, ph in p.phases.items() if ph.runs)
    assert p.phases.rollout.gather_once and not full.phases.rollout.gather_once
    ref = p.phases.reference
    assert "adapters off" in ref.what and all(REFERENCE_COPY not in ph.parts for _, ph in p.phases.items())
    assert "live gathered params" in ref.parts or "prefetch bucket" in ref.parts  # a ZeRO-3 forward
    assert p.phases.rollout.time.reference_s > 0 and p.time.terms.rollout < full.time.terms.rollout / 4
    assert p.time.seconds_per_step < full.time.seconds_per_step / 3


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_run_gathers_once_by_the_plans_rule_and_terms(monkeypatch, nodes):
    """A rollout gathers the whole model once by one rule, the plan's (Phase.room_to_gather_once): free memory >= the
    16-bit model + the phase's generate() terms. At run time (gathering.room_to_gather) the free memory is measured;
    in the plan it is the capacity less what the phase holds beside generate(). Given the plan's free memory, the
    run decides as the plan did, at 8B on 1 node (no: per-token gathers) and on 2 (yes, 3.5 GB to spare; the run's
    former rule, free >= 1.25 x the model, had 0.6 GB), and one byte less than the rule asks turns it to no."""
    import torch

    from zerotune import gathering
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.memory import GiB

    p = compute_plan(load_recipe("llama8b_grpo_zero3"), nodes=nodes)
    ro = p.phases.rollout
    whole = 2 * p.model.n_params
    gathered = ro.parts.get("whole model gathered once (16-bit)", 0)
    free = ro.capacity_bytes - (ro.peak_bytes - gathered - ro.generating_bytes)  # what the rank holds beside it
    assert ro.generating_bytes > 0 and ro.gather_once == (nodes == 2) and gathered == (whole if nodes == 2 else 0)

    class Shard:  # a ZeRO-3 parameter as room_to_gather reads it: its whole numel, a 16-bit shard
        ds_numel, ds_tensor = p.model.n_params, torch.empty(0, dtype=torch.float16)

    module = type("M", (), {"parameters": lambda self: [Shard()]})()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for room, says in ((free, ro.gather_once), (whole + ro.generating_bytes, True),
                       (whole + ro.generating_bytes - 1, False)):
        monkeypatch.setattr(gathering, "_available_ram", lambda: room)
        assert gathering.room_to_gather(module, "cpu", ro) is says, (nodes, room / GiB)


def test_the_hpz_column_counts_hpzs_copy_in_the_rollouts_room_to_gather():
    """ZeRO++ hpZ keeps a secondary copy of the parameters on every GPU (+2 GB at 8B over 8 GPUs), through every phase.
    llama8b_grpo_zero3 at micro-batch 4 on 2 nodes gathers its rollouts' model once (17 s a step); with hpZ the copy
    leaves no room for it, so the node table's hpZ column prices per-token gathers: minutes more per step, not hpZ's
    seconds saved."""
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan

    r = load_recipe("llama8b_grpo_zero3", ["train.micro_batch_size=4"])
    p = compute_plan(r, nodes=2)
    assert p.phases.rollout.gather_once
    two = next(row for row in p.time.nodes.rows if row.nodes == 2).on(p.time.cluster)
    assert two.terms.rollout == p.time.terms.rollout < 60
    assert two.hpz_terms.rollout > 10 * two.terms.rollout and two.hpz_seconds_per_step > two.seconds_per_step + 600


def test_a_prompt_that_leaves_less_than_max_new_tokens_stops_the_launch_in_one_line(tmp_path):
    """A micro-batch's completions get what its longest prompt leaves of data.seq_len (objective.rollouts), and the
    plan's rollout memory assumes every prompt leaves rl.max_new_tokens: a longer prompt would silently cut its
    neighbours' answers short, so the launch refuses it, naming the longest and the fix."""
    import datasets

    from zerotune.config import load_recipe
    from zerotune.errors import UserError
    from zerotune.layout import layout
    from zerotune.rl.prompts import refuse_long_prompts

    r = load_recipe("tiny_grpo", [f"output_dir={tmp_path}"])  # seq_len 64, max_new_tokens 8: prompts up to 56

    def prepared(prompt_lengths):
        rows = [{"input_ids": [5] * n + [7, 8], "labels": [-100] * n + [7, 8]} for n in prompt_lengths]
        datasets.Dataset.from_list(rows).save_to_disk(str(layout(r).data_train))

    prepared([10, 56, 30])
    refuse_long_prompts(r)
    prepared([10, 57, 60, 30])
    with pytest.raises(UserError) as e:
        refuse_long_prompts(r)
    msg = str(e.value)
    assert "2 of 4 GRPO prompts" in msg and "= 56 tokens (the longest, prepared row 2: 60)" in msg, msg
    assert "raise data.seq_len to 68, lower rl.max_new_tokens to 4" in msg and "\n" not in msg, msg
