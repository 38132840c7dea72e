"""`zerotune eval`: base vs fine-tuned HF vs GGUF per eval set, through the real CLI on a trained tiny run.

The 20-step tiny run (shared session fixture) has learned the answer format ("You said: ...") but not yet the
copying, so: on a format set the fine-tuned model beats the random-init base; on the exact task all three are
low; HF and its Q8_0 GGUF agree on both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _eval(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotune", "eval", "tiny", f"output_dir={out}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


def _format_set(tmp_path: Path, answer: str = "You said") -> Path:
    """The held-out prompts, scored on the answer's shape (what regex group 1 must be)."""
    rows = [json.loads(x) for x in (REPO / "data" / "tiny" / "heldout.jsonl").read_text().splitlines()[:30]]
    p = tmp_path / f"format{len(answer)}.jsonl"
    p.write_text("".join(json.dumps({"messages": r["messages"], "answer": answer}) + "\n" for r in rows))
    return p


# -- unit ---------------------------------------------------------------------------------------------------

def test_default_set_is_data_heldout_scored_exact():
    from zerotune.config import load_recipe

    (s,) = load_recipe("tiny").eval_sets()
    assert (s.name, s.path, s.scorer, s.max_new_tokens) == ("heldout", "data/tiny/heldout.jsonl", "exact", 12)


def test_recipe_scorer_names_come_from_the_scorers_table():
    import typing

    from zerotune.config import EvalSetCfg, RecipeError, load_recipe
    from zerotune.scorers import SCORERS

    assert set(typing.get_args(typing.get_type_hints(EvalSetCfg)["scorer"])) == set(SCORERS)
    with pytest.raises(RecipeError, match="eval.sets\\[0\\].scorer: 'exactly'.*Did you mean 'exact'"):
        load_recipe("tiny", ["eval.sets=[{name: t, path: x.jsonl, scorer: exactly}]"])
    with pytest.raises(RecipeError, match="names must be unique"):
        load_recipe("tiny", ["eval.sets=[{name: t, path: a.jsonl}, {name: t, path: b.jsonl}]"])


def test_leakage_keys_are_checked_at_load_and_explained():
    from zerotune.config import RecipeError, explain, load_recipe

    es = load_recipe("tiny", ["data.heldout=null", "eval.sets=[{name: t, path: a.jsonl}, {name: r, path: b.jsonl, "
                              "forbid: '^\\s*\\{', max_leakage: 0}]"]).eval.sets[1]
    assert (es.forbid, es.max_leakage) == (r"^\s*\{", 0.0)
    with pytest.raises(RecipeError, match=r"eval.sets\[1\].max_leakage=1.5: must be in \[0, 1\]"):
        load_recipe("tiny", ["data.heldout=null",
                             "eval.sets=[{name: t, path: a.jsonl}, {name: r, path: b.jsonl, max_leakage: 1.5}]"])
    with pytest.raises(RecipeError, match=r"eval.sets\[1\].forbid: '\(' is not a regular expression"):
        load_recipe("tiny", ["data.heldout=null",
                             "eval.sets=[{name: t, path: a.jsonl}, {name: r, path: b.jsonl, forbid: '('}]"])
    assert "    - forbid: None" in explain() and "    - max_leakage: None" in explain()


@pytest.mark.parametrize("content,match", [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', "line 1: needs 'messages'.*and 'answer'"),
    ('{"messages": [], "answer": "x"}\nnot json\n', "line 2: not valid JSON"),
])
def test_bad_rows_are_user_errors_with_file_and_line(tmp_path, content, match):
    from zerotune.config import EvalSetCfg
    from zerotune.errors import UserError
    from zerotune.answering import load_rows

    p = tmp_path / "set.jsonl"
    p.write_text(content)
    with pytest.raises(UserError, match=match):
        load_rows(EvalSetCfg(name="s", path=str(p)))


def test_regex_set_without_pattern_is_refused(tmp_path):
    from zerotune.config import EvalSetCfg
    from zerotune.errors import UserError
    from zerotune.answering import load_rows

    p = tmp_path / "set.jsonl"
    p.write_text('{"messages": [], "answer": "x"}\n')
    with pytest.raises(UserError, match="scorer regex needs a pattern"):
        load_rows(EvalSetCfg(name="s", path=str(p), scorer="regex"))
    assert load_rows(EvalSetCfg(name="s", path=str(p), scorer="regex", pattern="(x)"))[0]["answer"] == "x"


def test_local_lm_eval_task_scores_with_zerotunes_scorer(tmp_path):
    import importlib.util

    import yaml

    from zerotune.config import EvalSetCfg, load_recipe
    from zerotune.errors import UserError
    from zerotune.evaluate import write_local_task

    es = EvalSetCfg(name="f", path="f.jsonl", scorer="regex", pattern="^(You said):", max_new_tokens=7)
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
             "answer": "You said"}]
    d = write_local_task(load_recipe("tiny"), es, rows, "<|eot_id|>", tmp_path / "task")
    task = yaml.load((d / "zerotune_heldout.yaml").read_text().replace("!function", ""), Loader=yaml.SafeLoader)
    assert task["description"] == "Be brief." and task["generation_kwargs"]["until"] == ["<|eot_id|>"]
    assert task["generation_kwargs"]["max_gen_toks"] == 7
    assert json.loads((d / "data.jsonl").read_text()) == {"prompt": "hi", "answer": "You said"}
    spec = importlib.util.spec_from_file_location("task_utils", d / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    assert utils.process_results({"answer": "You said"}, ["You said: hi"]) == {"score": 1.0}
    assert utils.process_results({"answer": "You said"}, ["I said: hi"]) == {"score": 0.0}
    multi = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}], "answer": "x"}]
    with pytest.raises(UserError, match="row 1: .*one user message"):
        write_local_task(load_recipe("tiny"), es, multi, None, tmp_path / "task2")


@pytest.mark.slow
def test_missing_model_is_a_user_error_naming_the_stage(tmp_path):
    proc = _eval(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no fine-tuned model; run `make finetune RECIPE=tiny` first" in proc.stderr


def test_table_shows_leakage_per_model_and_a_dash_where_it_is_not_measured():
    from zerotune.evaluate import format_table

    table = [{"set": "task", "scorer": "json_fields", "n": 60, "base": 0.0, "hf": 0.667, "gguf": 0.683,
              "leakage": None},
             {"set": "retention", "scorer": "contains", "n": 40, "base": 0.825, "hf": 0.35, "gguf": 0.375,
              "leakage": {"base": 0.0, "hf": 0.55, "gguf": 0.525}}]
    head, _, task, keep = format_table(table).splitlines()
    assert head.split()[-4:] == ["leak", "base", "HF", "GGUF"]
    assert task.split()[-3:] == ["-", "-", "-"]
    assert keep.split()[-3:] == ["0.000", "0.550", "0.525"]
    assert len(keep) == len(head)  # the leak columns line up under their headers


def _fake_scored(tmp_path: Path, leakage: dict) -> tuple[list[str], dict]:
    """Overrides for two sets (a JSON task, a retention set with max_leakage 0.5) and the score_models result
    that answering.py would make of answers leaking `leakage`."""
    for name in ("task", "retention"):
        (tmp_path / f"{name}.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}], "answer": "a"}\n')
    sets = (f"eval.sets=[{{name: task, path: {tmp_path / 'task.jsonl'}, scorer: json_fields}}, {{name: retention, "
            f"path: {tmp_path / 'retention.jsonl'}, scorer: contains, max_leakage: 0.5}}]")
    one = {"answers": ["a"], "finish": ["stop"], "seconds": 1.0, "per_row": [1.0]}
    scored = {"models": {}, "sets": {"task": {m: {**one, "score": 1.0, "leakage": None} for m in leakage},
                                     "retention": {m: {**one, "score": 1.0 - v, "leakage": v}
                                                   for m, v in leakage.items()}}}
    return [f"output_dir={tmp_path / 'run'}", "data.heldout=null", sets], scored


@pytest.mark.slow
@pytest.mark.parametrize("gguf_leak,code", [(0.5, 0), (0.75, 1)])
def test_eval_writes_leakage_and_fails_past_max_leakage(tmp_path, monkeypatch, capsys, gguf_leak, code):
    import zerotune.evaluate as ev
    from zerotune.config import load_recipe

    overrides, scored = _fake_scored(tmp_path, {"base": 0.0, "hf": 0.25, "gguf": gguf_leak})
    monkeypatch.setattr(ev, "score_models", lambda r, sets, rows: scored)
    assert ev.evaluate(load_recipe("tiny", overrides)) == code
    res = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    table = {t["set"]: t for t in res["table"]}
    assert table["task"]["leakage"] is None
    assert table["retention"]["leakage"] == {"base": 0.0, "hf": 0.25, "gguf": gguf_leak}
    assert table["retention"]["max_leakage"] == 0.5
    out = capsys.readouterr().out
    assert "leak base" in out
    fail = "FAIL retention: GGUF answers 0.750 of the set in the task's format, more than 0.5 " \
           "(eval.sets[retention].max_leakage)"
    assert (fail in out) is bool(code) and "fine-tuned HF answers" not in out


# -- integration ----------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_eval_base_hf_gguf_side_by_side_and_lm_eval(tiny_eval_run, tmp_path):
    out, _ = tiny_eval_run
    fmt = _format_set(tmp_path)
    sets = (f"eval.sets=[{{name: format, path: {fmt}, scorer: regex, pattern: '^(You said):', max_new_tokens: 12,"
            f" max_drop: 0.0}}, {{name: task, path: data/tiny/heldout.jsonl, scorer: exact, max_new_tokens: 12,"
            f" limit: 30}}]")
    proc = _eval(out, "data.heldout=null", sets, "eval.lm_eval_tasks=[zerotune_heldout]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "eval" / "eval.json").read_text())
    table = {t["set"]: t for t in res["table"]}
    assert table["format"]["base"] <= 0.1 and table["format"]["hf"] >= 0.9, table
    for t in table.values():
        assert t["n"] == 30
        assert abs(t["hf"] - t["gguf"]) <= 0.1, t  # Q8_0 of the same weights: the same greedy answers, nearly
    agree = [h == g for h, g in zip(*(res["per_row"]["format"][m] for m in ("hf", "gguf")))]
    assert sum(agree) >= 27
    assert (out / "eval" / "eval.png").stat().st_size > 0
    assert "format" in proc.stdout and "GGUF" in proc.stdout
    # lm-evaluation-harness on the local task built from the first set (hf backend; the GGUF through zerotune's
    # server): the same scorer on the same prompts, so it must reproduce zerotune's own numbers
    lm = res["lm_eval"]["tasks"]["zerotune_heldout"]
    assert lm["n"] == 30
    assert lm["hf"] == pytest.approx(table["format"]["hf"], abs=0.05)
    assert lm["gguf"] == pytest.approx(table["format"]["gguf"], abs=0.05)
    assert abs(lm["hf"] - lm["gguf"]) <= 0.1
    assert "lm-eval zerotune_heldout" in proc.stdout


@pytest.mark.integration
def test_max_drop_fails_the_stage(tiny_eval_run, tmp_path):
    """A 'retention' set the fine-tune got worse at: the untrained base answers it better (it never says
    'You said', group 1 matches the empty answer); max_drop 0 must fail eval with exit 1 and name the set."""
    out, _ = tiny_eval_run
    fmt = _format_set(tmp_path, answer="")
    proc = _eval(out, "data.heldout=null", f"eval.sets=[{{name: retention, path: {fmt}, scorer: regex, "
                      f"pattern: '^(?!You said)()', max_new_tokens: 4, max_drop: 0.0, limit: 10}}]")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL retention: fine-tuned HF" in proc.stdout
