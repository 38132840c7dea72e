"""Preference tuning (DPO, issue 42): pairs as users have them and their bad rows, pairs prepared with labels on the
completions, the fused DPO loss against the DPO paper's formula (value and gradients), the batch, the recipe's
checks and the 8B plan; then real 2-process ZeRO-3 runs: one process equals two, a resume at another world size
equals the uninterrupted run, the reference log-probs are computed once and reused."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys

import pytest

from conftest import DPO_COMMON, REPO, finetune_on, read_metrics, tiny_random_model
from zerotune.config import RecipeError, from_dict
from zerotune.data.formats import Pair, read_row
from zerotune.errors import BadSample

U, A = "user", "assistant"


def msg(role, content):
    return {"role": role, "content": content}


# ---- pairs as users have them --------------------------------------------------------------------------------

ONE = Pair([msg(U, "2+2?")], [msg(A, "4")], [msg(A, "5")])
SHAPES = {
    "trl standard": ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "preference", {}),
    "trl conversational": ({"prompt": [msg(U, "2+2?")], "chosen": [msg(A, "4")], "rejected": [msg(A, "5")]},
                           "preference", {}),
    "ultrafeedback": ({"prompt": "2+2?", "prompt_id": "a1", "score_chosen": 8.0,
                       "chosen": [msg(U, "2+2?"), msg(A, "4")], "rejected": [msg(U, "2+2?"), msg(A, "5")]},
                      "preference", {"prompt_repeated": 1, "implicit_prompt": 1, "row:prompt_id": 1,
                                     "row:score_chosen": 1}),
    "implicit prompt": ({"chosen": [msg(U, "2+2?"), msg(A, "4")], "rejected": [msg(U, "2+2?"), msg(A, "5")]},
                        "preference", {"implicit_prompt": 1}),
    "hh-rlhf text": ({"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"},
                     "preference", {"hh_text": 1, "implicit_prompt": 1}),
    "openai": ({"input": {"messages": [msg(U, "2+2?")], "parallel_tool_calls": False},
                "preferred_output": [msg(A, "4")], "non_preferred_output": [msg(A, "5")]},
               "openai_preference", {"row:input.parallel_tool_calls": 1}),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_pair_shape_reads_as_one_prompt_and_two_completions(shape):
    row, fmt, notes = SHAPES[shape]
    doc = read_row(row, fmt, {}, "pairs.jsonl line 1")
    assert doc.conv == ONE and (doc.notes or {}) == notes


def test_a_multi_turn_pair_shares_its_history_and_the_prompt_carries_no_labels():
    hist = [msg(U, "hi"), msg(A, "Hello."), msg(U, "2+2?")]
    doc = read_row({"chosen": hist + [msg(A, "4")], "rejected": hist + [msg(A, "5")]}, "preference", {}, "t")
    assert doc.conv.prompt == [hist[0], {**hist[1], "weight": 0}, hist[2]]  # the history's reply: no labels
    assert doc.conv.chosen == [msg(A, "4")] and doc.conv.rejected == [msg(A, "5")]


BAD = {
    "identical": ({"prompt": "2+2?", "chosen": "4", "rejected": "4"}, "chosen and rejected are identical"),
    "empty completion": ({"prompt": "2+2?", "chosen": "4", "rejected": "  "}, "rejected is empty"),
    "no shared prompt": ({"chosen": [msg(U, "a"), msg(A, "4")], "rejected": [msg(U, "b"), msg(A, "5")]},
                         "chosen and rejected share no prompt"),
    "hh reply missing": ({"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant:"},
                         "content is empty"),
    "strings without prompt": ({"chosen": "4", "rejected": "5"}, "the row has no prompt field"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_pairs_are_refused_with_file_line_and_fix(case):
    row, reason = BAD[case]
    with pytest.raises(BadSample) as e:
        read_row(row, "preference", {}, "pairs.jsonl line 7")
    text = str(e.value)
    assert text.startswith("pairs.jsonl line 7") and reason in text and "Fix: " in text and "\n" not in text


@pytest.mark.slow
def test_bad_pair_rows_stop_make_data_in_one_line(tmp_path):
    """Through the CLI users run: exit 2, one line on stderr naming the file, the line and the fix."""
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n"
                    + json.dumps({"prompt": "3+3?", "chosen": "6", "rejected": "6"}) + "\n")
    recipe = tmp_path / "pairs.yaml"
    recipe.write_text(json.dumps({"model": {"init_config": "configs/models/tiny_llama31.json",
                                            "tokenizer": "assets/tokenizer/llama3_1"},
                                  "data": {"sources": [{"path": str(data), "format": "preference"}],
                                           "packing": False, "seq_len": 64},
                                  "preference": {"method": "dpo"}, "output_dir": str(tmp_path / "run")}))
    proc = subprocess.run([sys.executable, "-m", "zerotune", "data", str(recipe)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"zerotune: {data} line 2: chosen and rejected are identical"), err
    assert "data.on_bad_sample: skip" in err[0] and "Traceback" not in proc.stderr


# ---- prepared pairs ----------------------------------------------------------------------------------------------

def _recipe(tmp_path, tokenizer_dir, sources, **extra):
    raw = {"name": "t", "output_dir": str(tmp_path / "run"),
           "model": {"init_config": "configs/models/tiny_llama31.json", "tokenizer": str(tokenizer_dir)},
           "data": {"sources": sources, "seq_len": 64, "packing": False}, "preference": {"method": "dpo"}}
    for key, value in extra.items():
        section, field = key.split("__")
        raw.setdefault(section, {})[field] = value
    return from_dict(raw)


def test_a_prepared_pair_labels_its_completions_only(tmp_path, tokenizer_dir, tokenizer):
    from datasets import load_from_disk

    from zerotune.data.prepare import prepare
    from zerotune.layout import layout

    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Say {w}.", "chosen": f"{w}!", "rejected": f"No {w}."}) + "\n"
                           for w in ("red", "blue", "green")))
    r = _recipe(tmp_path, tokenizer_dir, [{"path": str(src), "format": "preference"}])
    m = prepare(r, histogram=False)
    assert m["pairs"]["train"] == 3 and m["sequences"]["train"] == 3
    rows = load_from_disk(str(layout(r).data_train))
    assert set(rows.column_names) >= {"input_ids", "labels", "rejected_input_ids", "rejected_labels", "pair"}
    for k, (row, w) in enumerate(zip(rows, ("red", "blue", "green"))):
        assert row["pair"] == k and f"Say {w}." in tokenizer.decode(row["input_ids"])
        for ids, labels, reply in ((row["input_ids"], row["labels"], f"{w}!"),
                                   (row["rejected_input_ids"], row["rejected_labels"], f"No {w}.")):
            first = next(i for i, t in enumerate(labels) if t != -100)
            assert labels[first:] == ids[first:], "labels are one run: the completion to the end"
            assert tokenizer.decode(ids[first:]) == f"{reply}<|eot_id|>"
        start = next(i for i, t in enumerate(row["labels"]) if t != -100)
        assert row["input_ids"][:start] == row["rejected_input_ids"][:start], "one prompt, the same tokens"


def test_the_recipe_refuses_what_dpo_cannot_do(tmp_path, tokenizer_dir):
    pairs = [{"path": "data/tiny/pairs.jsonl", "format": "preference"}]
    chats = [{"path": "data/tiny/train.jsonl", "format": "messages"}]
    cases = [({"sources": pairs}, {"preference": {"method": "none"}}, "only preference tuning reads"),
             ({"sources": chats}, {}, "use a pair format"),
             ({"sources": pairs, "packing": True}, {}, "pairs are not packed"),
             ({"sources": pairs}, {"peft": {"method": "lora"}}, "not supported yet"),
             ({"sources": pairs}, {"preference": {"method": "dpo", "loss": "robust", "label_smoothing": 0.6}},
              "robust takes [0, 0.5)"),
             ({"sources": pairs}, {"preference": {"method": "dpo", "nll_alpha": -1}}, "nll_alpha=-1.0: must be >= 0")]
    for data, extra, says in cases:
        raw = {"name": "t", "model": {"init_config": "configs/models/tiny_llama31.json", "tokenizer": str(tokenizer_dir)},
               "data": {"packing": False, **data}, "preference": {"method": "dpo"}, **extra}
        with pytest.raises(RecipeError) as e:
            from_dict(raw)
        assert says in str(e.value), (says, str(e.value))


def test_a_pair_counts_two_rows_of_the_global_batch():
    from zerotune.batch import BatchError, derive

    bp = derive(1024, 64, 4, 2, rows=2)
    assert bp.grad_accum == 1 and bp.sequences_per_step == 8 and bp.tokens_per_micro_step == 1024
    assert derive(1024, 64, 4, 1, rows=2).grad_accum == 2
    with pytest.raises(BatchError, match=r"2 rows x seq_len x micro-batch \(pairs\) x world = 2 x 64 x 4 x 3"):
        derive(1024, 64, 4, 3, rows=2)


# ---- the loss ----------------------------------------------------------------------------------------------------

def _pair_batch():
    """2 pairs: rows [chosen 1, chosen 2, rejected 1, rejected 2], right-padded, labels on the last tokens."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 12), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100
    mask = torch.ones_like(ids)
    for row, end in ((1, 10), (3, 9)):  # padding
        mask[row, end:] = 0
        labels[row, end:] = -100
    return ids, mask, labels


@pytest.mark.parametrize("loss_type,nll_alpha", [("sigmoid", 0.0), ("hinge", 0.0), ("sigmoid", 0.5)])
def test_fused_dpo_loss_equals_the_dpo_formula_and_its_gradients(loss_type, nll_alpha):
    """The fused loss (chunks of 3 label tokens, gradients computed in forward) against DPO's formula written out
    on the full logits, autograd's gradients of every parameter included; with nll_alpha, RPO's term: the chosen
    completions' token NLL averaged over their tokens (Liger's alpha x chosen_nll_loss, TRL's rpo_alpha)."""
    import torch
    import torch.nn.functional as F

    from zerotune.preference.loss import attach, dpo_loss_fn

    model, beta = tiny_random_model(), 0.1
    ids, mask, labels = _pair_batch()
    ref = torch.tensor([-40.0, -41.0, -45.0, -39.0])
    attach(model, dpo_loss_fn(beta, loss_type, nll_alpha=nll_alpha), chunk=3)
    # as training feeds it (objective.collate): right-padded rows with positions and no mask; the reference below
    # keeps the padding mask, so the two agree only if no real token sees a pad
    out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).repeat(ids.shape[0], 1), labels=labels,
                ref_logps=ref)
    out["loss"].backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    logps = (logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * (target != -100)).sum(-1)
    z = beta * ((logps[:2] - ref[:2]) - (logps[2:] - ref[2:]))
    want = (-F.logsigmoid(z) if loss_type == "sigmoid" else torch.relu(1 - z)).mean()  # the DPO paper; hinge: SLiC
    nll = F.nll_loss(logp[:2].reshape(-1, logp.shape[-1]), target[:2].reshape(-1), ignore_index=-100)  # token mean
    want = want + nll_alpha * nll
    want.backward()
    assert out["loss"].item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.allclose(out["logps"], logps.detach(), atol=1e-4)
    assert torch.allclose(out["rewards"], beta * (logps - ref).detach(), atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(fused[name], p.grad, rtol=1e-4, atol=1e-7), name
    # the model's own forward is untouched for everything else (generation, SFT validation, the save's probe)
    assert model(input_ids=ids).logits.shape == (4, 12, 512)


def test_fp16_gradients_stay_finite_when_d_loss_d_logp_is_large(monkeypatch):
    """sppo_hard's d loss / d logp is ~1 / beta: at beta 0.005 a fixed x1024 scale of the logits' gradient passes fp16's
    65,504 in forward, whatever DeepSpeed's loss scale. The scale follows the largest |d loss / d logp| instead: the
    fp16 gradients equal the fp32 ones computed the same way; with the fixed scale they are not finite."""
    import torch

    from zerotune.preference import loss as pl

    assert pl._grad_scale(0.05) == 1024.0 and pl._grad_scale(400.0) * 400.0 <= 16384.0
    assert pl._grad_scale(float("nan")) == 1024.0
    torch.manual_seed(0)
    h, w = torch.randn(6, 16), torch.randn(64, 16)
    targets, rows = torch.randint(0, 64, (6,)), torch.tensor([0, 0, 1, 2, 3, 3])
    ref = torch.tensor([-9.0, -8.0, -9.5, -7.5])

    def grads(dtype):
        hh, ww = h.to(dtype).detach().requires_grad_(), w.to(dtype).detach().requires_grad_()
        fn = pl.per_row(pl.dpo_loss_fn(0.005, "sppo_hard"), ref, rows, 4)
        loss = pl.FusedTokenLoss.apply(hh, ww, targets, fn, 4, None)[0]
        loss.backward()
        return hh.grad.float(), ww.grad.float()

    want = grads(torch.float32)
    for g16, g32 in zip(grads(torch.float16), want):
        assert torch.isfinite(g16).all()
        assert torch.allclose(g16, g32, rtol=2e-2, atol=2e-2 * float(g32.abs().max()))
    monkeypatch.setattr(pl, "_grad_scale", lambda g_max: pl.GRAD_SCALE)  # the fixed scale this replaced
    assert not all(torch.isfinite(g).all() for g in grads(torch.float16))


def test_the_attached_forward_shows_generate_the_models_own_parameters():
    """generate() reads the forward's signature (logits_to_keep, position ids from a left-padded mask)."""
    import inspect

    from zerotune.preference.loss import attach, dpo_loss_fn

    model = tiny_random_model()
    own = set(inspect.signature(model.forward).parameters)
    attach(model, dpo_loss_fn(0.1, "sigmoid"), chunk=3)
    seen = set(inspect.signature(model.forward).parameters)
    assert own <= seen and {"pair_logps", "ref_logps", "logits_to_keep"} <= seen


def test_a_micro_batch_puts_chosen_before_rejected_and_finds_their_reference():
    import torch

    from zerotune.preference.objective import Objective

    r = from_dict({"name": "t", "model": {"init_config": "configs/models/tiny_llama31.json"},
                   "data": {"sources": [{"path": "data/tiny/pairs.jsonl", "format": "preference"}], "packing": False},
                   "preference": {"method": "dpo"}})
    o = Objective(r, pad_id=0)
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "rejected_input_ids": [1, 9], "rejected_labels": [-100, 9],
             "pair": 5},
            {"input_ids": [4, 5], "labels": [-100, 5], "rejected_input_ids": [4, 6, 7, 8],
             "rejected_labels": [-100, 6, 7, 8], "pair": 2}]
    b = o.collate(rows)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [1, 9, 0, 0], [4, 6, 7, 8]]
    # right-padded rows of one document each: positions, no mask (the causal path keeps real tokens off the pads)
    assert "attention_mask" not in b and b["position_ids"].tolist() == [[0, 1, 2, 3]] * 4 and b["pair"].tolist() == [5, 2]
    o.reference = {"train": torch.arange(20, dtype=torch.float64).reshape(10, 2)}
    assert o.ref_logps("train", b["pair"], "cpu").tolist() == [10.0, 4.0, 11.0, 5.0]


# ---- the 8B plan -------------------------------------------------------------------------------------------------

def test_a_signal_during_the_reference_pass_stops_it_and_a_job_without_time_for_it_is_refused(tmp_path):
    """Issue 42 review: the reference pass runs before the first step, where the Trainer's step-boundary stop never
    looks. A SIGUSR1 during it stops it after the current forward (the job requeues, exit 75, instead of being killed
    inside it); and a job whose time before the warning cannot hold the planned pass (7 h on one 8xV100 node at 8B)
    is refused before launch, since a requeued attempt would stop in the same place again."""
    import time
    from types import SimpleNamespace

    import torch

    from zerotune.config import load_recipe
    from zerotune.errors import UserError
    from zerotune.planner.compute import compute_plan
    from zerotune.preference.reference import pair_logps
    from zerotune.stopping import StopBeforeTraining
    from zerotune.train.launch import _refuse_reference_pass_without_time

    calls = []

    def model(**kw):
        calls.append(1)
        return {"logps": torch.zeros(kw["input_ids"].shape[0])}

    def collate(rows):
        return {"input_ids": torch.zeros(2 * len(rows), 3, dtype=torch.long)}

    stop = SimpleNamespace(requested=None)
    assert pair_logps(model, list(range(6)), collate, 2, "cpu", stop=stop).shape == (6, 2) and len(calls) == 3
    stop.requested, calls[:] = "SIGUSR1", []
    with pytest.raises(StopBeforeTraining, match="SIGUSR1 received during the reference log-prob pass \\(1 of 3"):
        pair_logps(model, list(range(6)), collate, 2, "cpu", stop=stop)
    assert len(calls) == 1

    r = load_recipe("llama8b_dpo_zero3", [f"output_dir={tmp_path}"])
    plan = compute_plan(r)
    ref = plan.phases.reference
    assert ref.time.seconds is None  # the pairs are counted by `make data` (UltraFeedback is not here)
    # what the plan gives once they are: UltraFeedback's 61,135 training pairs (docs/training.md)
    seconds = ref.time.per_row_s * 2 * 61_135 / plan.cluster.world_size
    ref = dataclasses.replace(ref, time=dataclasses.replace(ref.time, seconds=seconds))
    plan = dataclasses.replace(plan, phases=dataclasses.replace(plan.phases, reference=ref))
    assert seconds > 3600
    with pytest.raises(UserError, match="--time at least"):
        _refuse_reference_pass_without_time(r, plan, time.time() + seconds / 2)
    _refuse_reference_pass_without_time(r, plan, time.time() + 2 * seconds)  # room: launched
    _refuse_reference_pass_without_time(r, plan, None)  # no known limit: launched


def test_the_8b_dpo_recipe_fits_every_phase_of_a_v100_and_plans_the_reference_pass():
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.memory import GiB

    p = compute_plan(load_recipe("llama8b_dpo_zero3"))
    assert p.cluster.gpu == "v100-32gb" and p.recipe_batch.fits and p.recipe_batch.grad_accum == 16
    assert [name for name, _ in p.phases.items()][:3] == ["train_step", "reference", "validation"]
    assert all(ph.fits for _, ph in p.phases.items() if ph.runs), {k: v.peak_bytes / GiB for k, v in p.phases.items()}
    # the fused loss: no sequence x vocabulary logits (SFT's would be 12 B x 128,256 x 8,192 tokens = 11.7 GiB)
    assert p.memory.parts["logits + loss"] < 4 * GiB and "no sequence x vocabulary logits" in p.memory.logits_how
    assert p.phases.reference.time.per_row_s > 0 and p.time.seconds_per_step > 0


# ---- real runs: 2 ZeRO-3 CPU processes ---------------------------------------------------------------------------

@pytest.mark.integration
def test_one_process_equals_two_and_a_resume_at_another_world_size_is_exact(tiny_dpo_reference, tmp_path):
    """The reference (conftest: 2 processes, 6 steps) against a run that starts on 1 process, is stopped after its
    first step by a deadline already passed (checkpoint-1 committed at world size 1), and resumes on 2 processes
    through the universal conversion: every step's loss and grad norm equal, the reference log-probs computed by
    1 process equal those of 2, and the resumed run reads them from the cache instead of recomputing them.
    The run folder's name has the characters DeepSpeed's converter and transformers' checkpoint glob misread
    (reshard.py's aliases; without them the conversion fails or the resume starts over)."""
    import shutil
    import time

    import torch

    ref = tiny_dpo_reference
    run = tmp_path / "run (copy)+[1]"
    for part in ("data", "base"):
        shutil.copytree(ref / part, run / part)

    rc, log = finetune_on(1, "tiny_dpo", run, *DPO_COMMON, ZEROTUNE_DEADLINE=str(int(time.time())))
    assert rc == 75 and "checkpointing at step 1 and stopping" in log, log[-3000:]
    assert "reference log-probs of the starting model: 600 pairs (570 train, 30 eval)" in log
    table = torch.load(run / "reference" / "logps.pt", weights_only=True)
    want = torch.load(ref / "reference" / "logps.pt", weights_only=True)
    for split in ("train", "eval"):
        assert torch.allclose(table[split], want[split], rtol=0, atol=1e-5), split  # 1 process = 2
    stamp = (run / "reference" / "logps.pt").stat().st_mtime_ns

    rc, log = finetune_on(2, "tiny_dpo", run, *DPO_COMMON)
    assert rc == 0, log[-3000:]
    assert "world size 1 -> 2" in log and "reference log-probs: cache hit" in log and "Traceback" not in log
    assert (run / "reference" / "logps.pt").stat().st_mtime_ns == stamp, "reused, not recomputed"
    a, b = read_metrics(ref), read_metrics(run)
    assert [x["step"] for x in b] == list(range(1, 7)), "every step exactly once"
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=5e-6), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)
        assert y["rewards/accuracy"] == x["rewards/accuracy"], (x, y)
    assert a[-1]["loss"] < a[0]["loss"], "DPO's loss fell from log 2"
    val = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_reward_accuracy" in row for row in val), "validation on the held-out pairs ran"


@pytest.mark.integration
def test_held_out_pairs_score_the_same_on_hf_and_its_gguf(tmp_path, tiny_model_dir, tiny_gguf):
    """eval.pairs through scoring.py: the HF model's log-probs (the training code's chunked ones) and the GGUF's
    (llama.cpp's logits over the same token ids) agree; a model scored against itself has reward margin 0; a second
    call reads the cache."""
    import shutil

    from zerotune.layout import layout
    from zerotune.preference.scoring import score_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((REPO / "data" / "tiny" / "heldout_pairs.jsonl").read_text().splitlines(True)[:8]))
    r = from_dict({"name": "t", "output_dir": str(tmp_path / "run"),
                   "model": {"name_or_path": str(tiny_model_dir), "tokenizer": str(tiny_model_dir)},
                   "data": {"sources": [{"path": "data/tiny/pairs.jsonl", "format": "preference"}], "packing": False},
                   "preference": {"method": "dpo"}, "eval": {"pairs": {"path": str(pairs), "format": "preference"}}})
    paths = layout(r)
    shutil.copytree(tiny_model_dir, paths.model)  # the "tuned" model: the starting weights themselves
    paths.gguf.parent.mkdir(parents=True)
    shutil.copy(tiny_gguf, paths.gguf)
    p = score_pairs(r)
    assert p["n"] == 8 and p["hf"]["accuracy"] == p["base"]["accuracy"]
    assert p["hf"]["reward_accuracy"] == 0 and p["hf"]["reward_margin"] == 0  # no pair's margin moved
    assert p["gguf"]["accuracy"] == p["hf"]["accuracy"] and abs(p["gguf"]["reward_margin"]) < 0.01  # Q8_0 noise
    cache = json.loads((paths.eval / "pairs.json").read_text())
    assert len(cache) == 3 and score_pairs(r)["seconds"] == p["seconds"], "the second call reads the cache"


def test_a_completion_that_is_json_text_stays_text():
    """The SmolLM2 task's replies are JSON records: a string completion is a reply, whatever it looks like."""
    row = {"prompt": "Extract: Ada, 36", "chosen": '{"name": "Ada", "age": 36}', "rejected": '[{"name": "Ada"}]'}
    doc = read_row(row, "preference", {}, "t")
    assert doc.conv.chosen == [msg(A, row["chosen"])] and doc.conv.rejected == [msg(A, row["rejected"])]
    as_text = {**row, "chosen": json.dumps([msg(A, "x")])}  # a message list stored as JSON text (a CSV cell)
    assert read_row(as_text, "preference", {}, "t").conv.chosen == [msg(A, "x")]


def test_the_dpo_plan_and_its_reference_gate_take_the_prepared_pairs_padded_rows(tmp_path):
    """Issue 53 (1): a pair is padded to its own longer row, not to seq_len. Before `make data` the plan times DPO at
    the seq_len bound and says so; with the data manifest's mean padded row it times the step, the reference pass
    and validation at that length (what the launcher's reference-pass gate reads), and the fp16 scale at the
    measured label tokens. Memory stays at the bound: the longest micro-batch sets the peak."""
    from zerotune import manifest as mf
    from zerotune.config import load_recipe
    from zerotune.layout import layout
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.report import dry_run

    r = load_recipe("llama8b_dpo_zero3", [f"output_dir={tmp_path}"])
    before = compute_plan(r)
    assert before.time.row_tokens_from.startswith("the data.seq_len bound")
    assert before.time.tokens_per_step == r.train.global_batch_tokens
    mf.write(layout(r).data_manifest, {  # as make data writes it for 60,000 pairs of ~800 tokens, 300 labels a row
        "sequences": {"train": 60000, "eval": 600}, "tokens": {"train_label": 60000 * 2 * 300},
        "packing": {"enabled": False, "seq_len": 4096}, "doc_length": {"p50": 700, "p99": 3000},
        "pairs": {"train": 60000, "eval": 600, "padded_row_tokens_mean": 800.0}})
    after = compute_plan(r)
    assert after.time.row_tokens_from.startswith("the prepared pairs' mean padded row")
    assert after.time.tokens_per_step == pytest.approx(r.train.global_batch_tokens * 800 / 4096)
    assert after.time.seconds_per_step < before.time.seconds_per_step / 4
    ref_b, ref_a = before.phases.reference.time, after.phases.reference.time
    assert ref_a.per_row_s < ref_b.per_row_s / 4 and ref_a.seconds is not None
    assert after.memory.peak_bytes == before.memory.peak_bytes
    assert after.data.label_tokens_per_row == 300
    assert "300 label tokens per row)" in dry_run(after, r) and "assumed until `make data`" in dry_run(before, r)


def test_the_reference_cache_key_is_the_weights_content_not_their_path_or_times(tiny_model_dir, tmp_path):
    """Issue 53 (5): a node-local copy of the same base (another path, other file times) or a re-download keys the
    same table; a model whose values moved does not. Read on rank 0 and broadcast (without a process group: here)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from zerotune.hardware import Choice
    from zerotune.preference.reference import cache_key

    choice = Choice("fp32", "sdpa_docs", False, ())
    copy = tmp_path / "node2" / "base"
    shutil.copytree(tiny_model_dir, copy)
    for f in copy.iterdir():
        os.utime(f, (1, 1))
    a, b = cache_key("data1", tiny_model_dir, choice), cache_key("data1", copy, choice)
    assert a == b and str(tiny_model_dir) not in json.dumps(a)
    assert cache_key("data2", copy, choice)["key"] != a["key"]
    weights = load_file(str(copy / "model.safetensors"))
    save_file({k: v + 1e-3 if v.dtype == torch.float32 else v for k, v in weights.items()},
              str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert cache_key("data1", copy, choice)["key"] != a["key"]
    # .bin weights (save_pretrained's older format) are keyed by their bytes too, not by config.json alone
    bins = tmp_path / "bins"
    bins.mkdir()
    shutil.copy(copy / "config.json", bins / "config.json")
    torch.save(weights, bins / "pytorch_model.bin")
    first = cache_key("data1", bins, choice)["key"]
    torch.save({k: v * 2 for k, v in weights.items()}, bins / "pytorch_model.bin")
    assert cache_key("data1", bins, choice)["key"] != first


def test_pair_rows_have_no_mask_except_gemmas_sliding_layers_under_sdpa():
    """DPO's right-padded pairs pass no mask (SDPA is_causal), so the plan counts none; but transformers gives
    Gemma 3's sliding-window layers a (rows, 1, S, S) mask under sdpa/eager once a row reaches the window
    (masking_utils.py), which the plan then counts. sdpa_docs builds none (attention.py document_mask)."""
    from conftest import REPO

    from zerotune.planner.memory import attention_has_mask, pair_rows_padded, shape_of

    llama = shape_of(str(REPO / "configs" / "models" / "llama31_8b.json"))
    gemma = shape_of(str(REPO / "configs" / "models" / "gemma3_12b.json"))
    assert gemma.sliding_layers and not llama.sliding_layers
    for m, attention, mask in ((llama, "sdpa", False), (llama, "sdpa_docs", False), (gemma, "sdpa_docs", False),
                               (gemma, "sdpa", True), (gemma, "eager", True)):
        assert attention_has_mask(attention, False, 4, pair_rows_padded(m, attention)) is mask, (attention, mask)
