"""Evaluation during training (train/validation.py): validation loss under real ZeRO-3 on 2 CPU processes equals a
one-process computation, an evaluation in the middle of training leaves the training losses alone, samples are
written. The unit tests at the top check the loss arithmetic itself against an independent cross entropy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


def _independent_val_loss(model_dir: Path, eval_dir: Path) -> tuple[float, int]:
    """Summed CE over label tokens / label tokens, written from scratch (no zerotune code): logits at t predict
    the label at t + 1, position_ids restart per packed document."""
    import torch
    import torch.nn.functional as F
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for row in load_from_disk(str(eval_dir)):
            logits = model(input_ids=torch.tensor([row["input_ids"]]), position_ids=torch.tensor([row["position_ids"]]),
                           use_cache=False).logits[0].double()
            target = torch.tensor(row["labels"][1:])
            keep = target != -100
            total += F.cross_entropy(logits[:-1][keep], target[keep], reduction="sum").item()
            n += int(keep.sum())
    return total / n, n


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "train" / "metrics.jsonl").read_text().splitlines() if x.strip()]


# -- unit ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,world", [(7, 2), (1, 2), (8, 2), (5, 3)])
def test_shards_are_disjoint_complete_and_equal_length(n, world):
    from zerotune.train.validation import shard

    shards = [shard(n, r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "every rank must make the same number of forward calls"
    real = sorted(i for s in shards for i in s if i is not None)
    assert real == list(range(n))


@pytest.mark.slow
def test_nll_sum_matches_independent_ce_and_dummy_adds_nothing(tiny_model_dir, tmp_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from zerotune.train.validation import distributed_val_loss, nll_sum

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):  # two packed documents per row, prompt tokens masked
        ids = torch.randint(0, 1000, (64,), generator=g).tolist()
        labels = ids[:1] + [-100] * 9 + ids[10:32] + [-100] * 12 + ids[44:]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": list(range(32)) + list(range(32))})
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "eval"))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        loss, n = distributed_val_loss(model, Dataset.from_list(rows), torch.device("cpu"))
        dummy = {**rows[0], "labels": [-100] * 64}
        assert nll_sum(model, [dummy], torch.device("cpu")) == (0.0, 0)
    ref, ref_n = _independent_val_loss(tiny_model_dir, tmp_path / "eval")
    assert n == ref_n == 3 * (22 + 20)  # a label at position 0 has no prediction (HF's shift drops it)
    assert loss == pytest.approx(ref, rel=1e-6)


@pytest.mark.slow
def test_samples_are_answerings_greedy_answers_and_leave_the_model_as_training_had_it(tiny_model_dir, tmp_path):
    """The in-training samples go through answering.py: on a model as training holds it (train mode, no KV cache
    in its config) they equal check's and eval's batched greedy answers to the same prompts, with the same stop
    tokens; afterwards the model is in train mode with its cache off again."""
    from types import SimpleNamespace

    import torch

    from zerotune.answering import hf_generate, load_hf, load_rows
    from zerotune.config import load_recipe
    from zerotune.train.validation import EvalDuringTraining

    r = load_recipe("tiny", [f"output_dir={tmp_path}"])
    es = r.eval_sets()[0]
    rows = load_rows(es)[: r.eval.samples]
    model, tok, stop = load_hf(tiny_model_dir)
    want = hf_generate(model, tok, stop, rows, es.max_new_tokens, batch_size=r.eval.batch_size)  # as check, eval
    model.train()
    model.config.use_cache = False
    cb = EvalDuringTraining(r)
    cb._prompts = (rows, es, tok, stop)  # what _sample_prompts reads from the run's tokenizer and base model
    cb._evaluate(SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(is_world_process_zero=True), model, 5)
    samples = [json.loads(x) for x in (tmp_path / "train" / "samples.jsonl").read_text().splitlines()]
    assert [s["prediction"] for s in samples] == want and len(want) == r.eval.samples
    assert [s["step"] for s in samples] == [5] * len(want)
    assert model.training and model.config.use_cache is False


# -- integration: real ZeRO-3, 2 processes --------------------------------------------------------------------

@pytest.mark.integration
def test_val_loss_under_zero3_equals_one_process_on_the_saved_model(tiny_eval_run):
    out, log = tiny_eval_run
    rows = _rows(out)
    val = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(val) == [10, 20]
    assert all("loss" in r for r in val.values()), "val_loss sits in the step's own row"
    assert val[20]["val_loss"] < val[10]["val_loss"]
    # the final evaluation ran on the weights that were published: same numbers from one plain process
    ref, n = _independent_val_loss(out / "model", out / "data" / "eval")
    assert val[20]["val_tokens"] == n
    assert val[20]["val_loss"] == pytest.approx(ref, rel=1e-5)
    assert val[20]["val_ppl"] == pytest.approx(math.exp(ref), rel=1e-5)
    assert "finetune: eval: step 10, val_loss" in log


@pytest.mark.integration
def test_evaluating_mid_training_leaves_the_training_losses_unchanged(tiny_eval_run, tiny_trained_20):
    with_eval, without = _rows(tiny_eval_run[0]), _rows(tiny_trained_20[0])
    assert [r["step"] for r in with_eval] == [r["step"] for r in without] == list(range(1, 21))
    for a, b in zip(without, with_eval):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)
    # eval_steps=0 still measures once, at the end
    assert [r["step"] for r in without if "val_loss" in r] == [20]
    assert without[-1]["val_loss"] == pytest.approx(with_eval[-1]["val_loss"], rel=1e-6)


@pytest.mark.integration
def test_samples_gathered_once_equal_samples_gathered_per_token(tiny_eval_run, tiny_trained_20):
    """Issue 41: under ZeRO-3 the samples gather the whole model once per round where it fits (train/validation.py
    whole_model, as TRL's unwrap_model_for_generation), not once per generated token; the answers are the same as
    the per-token path's (tiny_trained_20 has no room, by fault injection: the same final weights), and the
    training after a gathered round is unchanged (test_evaluating_mid_training_leaves_the_training_losses_unchanged)."""
    def last(out):
        return [(s["prompt"], s["prediction"]) for s in map(json.loads, (out / "train" / "samples.jsonl").read_text()
                                                             .splitlines()) if s["step"] == 20]

    assert "(the whole model gathered once)" in tiny_eval_run[1]
    assert "gathered once" not in tiny_trained_20[1]
    assert len(last(tiny_eval_run[0])) == 4 and last(tiny_eval_run[0]) == last(tiny_trained_20[0])


@pytest.mark.integration
def test_samples_and_curves_are_written(tiny_eval_run):
    out, _ = tiny_eval_run
    samples = [json.loads(x) for x in (out / "train" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [s for s in (10, 20) for _ in range(4)]  # eval.samples = 4
    assert {s["set"] for s in samples} == {"heldout"}
    assert all(s["reference"].startswith("You said:") and isinstance(s["prediction"], str) for s in samples)
    assert all(s["score"] in (0.0, 1.0) for s in samples)
    assert (out / "train" / "curves.png").stat().st_size > 0
