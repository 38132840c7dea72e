"""Self-distilled replay (data.replay): the recipe keys, the prompt file's rules, the cache of the base model's
answers (by weights, prompts and template), the mix at the stated ratio, and a real run of SmolLM2 answering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotune.config import EvalSetCfg, RecipeError, explain, from_dict, load_recipe
from zerotune.data import replay as rp
from zerotune.data.cache import StaleDataError, require_prepared
from zerotune.data.prepare import prepare
from zerotune.data.replay_prompts import ReplayError, load_prompts
from zerotune.layout import layout

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"
GENERAL = REPO / "data" / "general" / "prompts.jsonl"


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def ask(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def task_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Repeat after me: word{i}"},
                          {"role": "assistant", "content": f"You said: word{i}"}]} for i in range(n)]


def smol_recipe(tmp_path: Path, prompts: Path, **replay) -> object:
    return from_dict({"name": "t", "output_dir": str(tmp_path / "run"),
                      "model": {"name_or_path": str(SMOLLM2), "tokenizer": str(SMOLLM2)},
                      "data": {"sources": [{"path": str(write_jsonl(tmp_path / "task.jsonl", task_rows(30)))}],
                               "seq_len": 256, "replay": {"path": str(prompts), **replay}},
                      "eval": {"batch_size": 4}})


# ---- the recipe -----------------------------------------------------------------------------------------

def test_replay_keys_are_typed_and_checked():
    r = load_recipe("smollm2", ["data.replay.ratio=0.3", "data.replay.max_new_tokens=64"])
    assert r.data.replay.ratio == 0.3 and r.data.replay.max_new_tokens == 64
    assert load_recipe("smollm2", ["data.replay=null"]).data.replay is None
    with pytest.raises(RecipeError, match="Did you mean 'ratio'"):
        load_recipe("smollm2", ["data.replay.ration=0.3"])
    with pytest.raises(RecipeError, match=r"data.replay.ratio=1.0: must be in \(0, 1\)"):
        load_recipe("smollm2", ["data.replay.ratio=1"])
    with pytest.raises(RecipeError, match="initialised at random"):  # a random model has nothing to replay
        load_recipe("tiny", ["data.replay.path=data/general/prompts.jsonl"])
    assert "    max_new_tokens: 128" in explain()  # the sub-section's fields are documented


def test_the_resolved_recipe_keeps_replay():
    r = load_recipe("smollm2")
    assert from_dict(r.to_dict()) == r and r.data.replay is not None


def test_prompt_file_rules(tmp_path):
    cases = {
        "not json": ("{oops", "not valid JSON"),
        "assistant last": ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
                           "ends with the user turn"),
        "an answer given": ({**ask("Hi"), "answer": "Hello"}, r"unexpected key\(s\) \['answer'\]"),
        "no messages": ({"prompt": "Hi"}, "needs 'messages'"),
    }
    for name, (row, msg) in cases.items():
        r = smol_recipe(tmp_path, write_jsonl(tmp_path / f"{name}.jsonl", [ask("ok"), row]))
        with pytest.raises(ReplayError, match=msg) as e:
            load_prompts(r)
        assert "line 2" in str(e.value), name
    r = smol_recipe(tmp_path, write_jsonl(tmp_path / "p.jsonl", [ask(f"q{i}") for i in range(10)]), limit=3)
    assert len(load_prompts(r)) == 3


def test_prompts_that_are_eval_prompts_are_refused(tmp_path):
    held = write_jsonl(tmp_path / "held.jsonl", [{**ask("What is the capital of France?"), "answer": "Paris"}])
    prompts = write_jsonl(tmp_path / "p.jsonl", [ask("Name a colour."), ask("what is the capital of france")])
    r = smol_recipe(tmp_path, prompts)
    r.eval.sets = [EvalSetCfg(name="retention", path=str(held))]
    with pytest.raises(ReplayError, match="1 prompt\\(s\\) also in eval set 'retention'.*train on the test"):
        rp.check_disjoint(r, load_prompts(r))


def test_the_shipped_prompts_are_disjoint_from_every_shipped_eval_set():
    for name in ("smollm2", "smollm2_lora"):
        r = load_recipe(name)
        rp.check_disjoint(r, load_prompts(r))
    r = load_recipe("llama8b_zero3", ["data.replay.path=data/general/prompts.jsonl"])  # data.heldout
    assert len(load_prompts(r)) == 320
    rp.check_disjoint(r, load_prompts(r))


# ---- answering, caching, mixing (SmolLM2, real generation) -----------------------------------------------

SHORT = ["Say hello in one word.", "Is ice cold or hot? One word.", "Name a colour. One word.",
         "Reply with the word yes.", "Write one long essay about the history of every country in Europe."]


@pytest.mark.integration
def test_base_model_answers_once_and_the_mix_meets_the_ratio(tmp_path, capsys):
    if not (SMOLLM2 / "config.json").exists():
        pytest.fail(f"{SMOLLM2} missing: run `make setup`")
    prompts = write_jsonl(tmp_path / "p.jsonl", [ask(t) for t in SHORT])
    r = smol_recipe(tmp_path, prompts, ratio=0.25, max_new_tokens=12)
    m = prepare(r, histogram=False)
    rep = m["replay"]
    assert rep["cached"] is False and rep["prompts"] == 5 and rep["device"] == "cpu"
    assert rep["kept"] + rep["empty"] == 5 and rep["cut_off"] >= 1  # the essay runs past 12 tokens
    answers = [json.loads(x) for x in Path(rep["answers"]).read_text().splitlines()]
    assert len(answers) == rep["kept"]
    assert [a["messages"][:-1] for a in answers] == [ask(t)["messages"] for t in SHORT][:len(answers)]
    assert all(a["messages"][-1]["role"] == "assistant" and a["messages"][-1]["content"] for a in answers)
    assert sum(a["messages"][-1].get("truncated", False) for a in answers) == rep["cut_off"]
    assert answers[-1]["messages"][-1]["truncated"] is True  # the essay, kept without its end of turn
    # 30 task rows at ratio 0.25: 10 replay documents
    assert rep["documents"] == 10 and m["sources"][-1]["taken"] == 10 and m["counts"]["docs_out"] == 40
    out = capsys.readouterr().out
    assert "the base model" in out and f"{rep['kept']} of 5 base-model answers kept" in out

    # the same prompts, weights and template: a repack (seq_len) reuses the answers; the fingerprint holds them
    r2 = smol_recipe(tmp_path, prompts, ratio=0.25, max_new_tokens=12)
    r2.data.seq_len = 512
    assert prepare(r2, histogram=False)["replay"]["cached"] is True
    require_prepared(r2)
    # other prompts: the prepared data is stale, and preparing answers again
    write_jsonl(prompts, [ask(t) for t in SHORT[:4]])
    with pytest.raises(StaleDataError, match="replay.prompts_sha256"):
        require_prepared(r2)
    again = prepare(r2, histogram=False)["replay"]
    assert again["cached"] is False and again["key"] != rep["key"] and again["prompts"] == 4
    assert sorted(p.name for p in layout(r2).replay.iterdir()) == sorted(
        f"answers-{k}.{e}" for k in (rep["key"], again["key"]) for e in ("json", "jsonl"))


def test_a_truncated_reply_trains_its_text_not_its_end_of_turn(tokenizer):
    from zerotune.data.formats import validate_messages
    from zerotune.data.tokenize import IGNORE, encode_chat

    def label_text(msgs):
        ids, labels = encode_chat(tokenizer, validate_messages(msgs, "row"), "all_assistant", "row")
        return tokenizer.decode([t for t in labels if t != IGNORE])

    reply = "Octopuses have three hearts and blue blood, and each"
    whole = [{"role": "user", "content": "Tell me about octopuses."}, {"role": "assistant", "content": reply}]
    assert label_text(whole) == reply + "<|eot_id|>"
    cut = [whole[0], {**whole[1], "truncated": True}]
    assert label_text(cut) == reply
    with pytest.raises(Exception, match="'truncated' must be true or false, on an assistant turn"):
        validate_messages([{**whole[0], "truncated": True}, whole[1]], "row 3")


def test_replay_answers_in_the_familys_precision_on_a_v100(monkeypatch, tmp_path):
    """Issue 41 item 2: the replay step chose its precision without the model family, so a Gemma 3 base answered in
    fp16 on a V100 or T4 (families.py refuses Gemma 3 in fp16; its activations overflow). It answers in fp32 there,
    a Llama in fp16; the plan books the same."""
    import torch

    from zerotune import hardware
    from zerotune.data.replay import _device_and_dtype
    from zerotune.families import FAMILIES
    from zerotune.planner.compute import compute_plan

    monkeypatch.setattr(hardware, "detect", lambda: hardware.GPUS["v100-32gb"])
    monkeypatch.setattr(rp, "detect", hardware.detect)  # data/replay.py imports it by name
    assert _device_and_dtype(FAMILIES["gemma3"])[1:] == (torch.float32, "fp32")
    assert _device_and_dtype(FAMILIES["llama"])[1:] == (torch.float16, "fp16")
    replay = ["data.replay.path=data/general/prompts.jsonl", "plan.gpu=v100-32gb", "model.init_config=null"]
    for name in ("gemma3", "llama31"):  # a "pretrained" folder: replay needs one (a random init has nothing to replay)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((REPO / "configs" / "models" / f"tiny_{name}.json").read_text())
    gemma = load_recipe("tiny_gemma3", [*replay, f"model.name_or_path={tmp_path / 'gemma3'}"])
    llama = load_recipe("tiny", [*replay, f"model.name_or_path={tmp_path / 'llama31'}"])
    assert compute_plan(gemma).replay.precision == "fp32"
    assert compute_plan(llama).replay.precision == "fp16"
