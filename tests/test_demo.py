"""`make demo` end to end: the last line is the JSON summary and it meets the bar in the README.

tiny_qlora: adapters on a 4-bit NF4 base, merged into the fp32 base, exported to Q8_0 and checked (issue 8's
"whole chain on CPU passes its check"). `make demo` on tiny (full fine-tuning under ZeRO-3, 7 minutes) is not
repeated here: the same stages under ZeRO-3 on 2 processes run in test_smollm2 on the real model, whose log is
held to the same noise list (CI budget, issue 15)."""

import json
import subprocess

import pytest

from conftest import NOISE, REPO

pytestmark = pytest.mark.integration


def assert_readable_log(proc, recipe, out):
    """What a person reads: short, each step once, progress with time left, and where to go next at the end."""
    log = proc.stdout + proc.stderr
    lines = log.splitlines()
    assert len(lines) < 150, f"{len(lines)} lines:\n" + log[-5000:]
    for noise in NOISE:
        assert noise not in log, (noise, log[-5000:])
    steps = [x.split(",")[0] for x in lines if x.startswith("finetune: step ")]
    assert steps and len(steps) == len(set(steps)), steps  # every logged step printed once
    assert "finetune: 100% (" in proc.stderr and " left" in proc.stderr  # progress in a log file: one line per 10%
    for stage in ("data", "finetune", "quantize", "check"):
        assert f"== zerotune {stage} {recipe}: " in proc.stdout
    *_, done, nxt = proc.stderr.strip().splitlines()
    assert done == f"demo: done; the GGUF is {out / 'gguf' / f'{recipe}-q8_0.gguf'}", done
    assert nxt.startswith(f'next: make serve RECIPE={recipe} ARGS="output_dir={out}"'), nxt


@pytest.mark.extended  # QLoRA's chain; CI covers QLoRA in test_peft.py (2 processes == 1)
def test_make_demo_qlora(tmp_path):
    recipe = "tiny_qlora"
    proc = subprocess.run(["make", "-s", "demo", f"RECIPE={recipe}", f"ARGS=output_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_readable_log(proc, recipe, tmp_path)
    last = proc.stdout.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["base_accuracy"] <= 0.1
    assert summary["hf_accuracy"] >= 0.9 and summary["gguf_accuracy"] >= 0.9
    assert abs(summary["hf_accuracy"] - summary["gguf_accuracy"]) <= 0.02
    assert summary["passed"] is True
    check = json.loads((tmp_path / "check" / "check.json").read_text())
    assert check["agreement"]["mean_kl"] <= 0.01 and check["agreement"]["top1_gated"] >= 0.98
    v = json.loads((tmp_path / "train" / "manifest.json").read_text())["verify"]
    assert v["method"] == "qlora"
    assert v["adapter_reload_max_abs_logit_diff"] < 1e-3  # same 4-bit base + reloaded adapter == trained
    assert v["merge_max_abs_logit_diff"] < 1e-3           # merged fp32 model == fp32 base + adapter
    assert v["max_abs_logit_diff"] < 1e-3                 # saved merged model reloads identically
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert not list((tmp_path / "model").glob("adapter_*")), "the published model is merged, not an adapter"
    q = json.loads((tmp_path / "gguf" / "manifest.json").read_text())
    assert q["type"] == "q8_0"


def _serve_and_ask(recipe: str, out, prompt: str) -> tuple[str, str]:
    """`zerotune serve` on the demo's GGUF, asked once through the official `openai` client: (content, finish)."""
    import signal
    import sys
    import time

    from openai import OpenAI

    from zerotune.ports import free_port

    port = free_port()
    log = open(out / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zerotune", "serve", recipe, f"output_dir={out}",
                             f"serve.port={port}", "serve.n_ctx=512"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
    try:
        deadline = time.time() + 120
        while True:
            try:
                client.models.list()
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None and time.time() < deadline, (out / "serve.log").read_text()[-2000:]
                time.sleep(0.5)
        res = client.chat.completions.create(model=recipe, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=24, temperature=0)
        return res.choices[0].message.content or "", res.choices[0].finish_reason
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


@pytest.mark.extended  # each family's whole chain; CI converts each family's tiny model (tests/test_families.py)
@pytest.mark.parametrize("recipe", ["tiny_qwen3", "tiny_gemma3"])
def test_make_demo_per_family(recipe, tmp_path):
    """The whole chain on another architecture: its template in the data, ZeRO-3 on 2 CPU ranks, llama.cpp's
    converter (pre-tokenizer recognised, token ids identical, the family's end of turn ends generation), eval,
    check, and the server answering through the `openai` client."""
    from zerotune.families import FAMILIES, answer_text

    proc = subprocess.run(["make", "-s", "demo", f"RECIPE={recipe}", f"ARGS=output_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_readable_log(proc, recipe, tmp_path)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["base_accuracy"] <= 0.1 and summary["passed"] is True
    assert summary["hf_accuracy"] >= 0.9 and summary["gguf_accuracy"] >= 0.9
    assert summary["mean_kl"] <= 0.01
    family = FAMILIES[recipe.removeprefix("tiny_")]
    q = json.loads((tmp_path / "gguf" / "manifest.json").read_text())["checks"]
    assert q["architecture"] == family.gguf_arch and q["pre_tokenizer"] not in (None, "default")
    assert q["turn_end_token"] == family.end_of_turn and q["eot_is_eog"] is True
    assert q["probe_texts_identical"] == 8 and q["tensor_types"].keys() == {"F32", "Q8_0"}
    content, finish = _serve_and_ask(recipe, tmp_path, "Repeat after me: orange frog tea")
    assert finish == "stop" and answer_text(family, content) == "You said: orange frog tea", content
    if family.thinking:  # served as trained: the empty thinking block first
        assert content.startswith("<think>"), content


def _demo_after_smollm2_sft(tmp_path, recipe: str) -> tuple[dict, str]:
    """The smollm2 SFT run (into tmp_path/sft; the recipe's own runs/smollm2/model is trained by the demo when
    missing), then `make demo RECIPE=recipe` from its model: (check's JSON summary, the log), no known noise."""
    from conftest import zt

    sft = tmp_path / "sft"
    for stage in ("data", "finetune"):
        zt(stage, "smollm2", f"output_dir={sft}", timeout=3600)
    proc = subprocess.run(["make", "-s", "demo", f"RECIPE={recipe}",
                           f"ARGS=output_dir={tmp_path / recipe} model.name_or_path={sft / 'model'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=5400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for noise in NOISE:
        assert noise not in log, noise
    return json.loads(proc.stdout.strip().splitlines()[-1]), log


@pytest.mark.extended  # the SmolLM2 SFT + DPO chains (43 min here, 2026-11-27); CI: tests/test_preference.py (below)
def test_make_demo_smollm2_dpo(tmp_path):
    """Preference tuning after SFT on the real model, as `make demo RECIPE=smollm2_dpo` runs it: the SFT run first
    (here into tmp_path/sft; the recipe's own runs/smollm2/model is trained by the demo when missing), then DPO
    through the whole chain. Held-out preference accuracy rises from the SFT model to the DPO model, the held-out task
    gains at least 0.1 (measured 0.700 -> 0.933), retention stays within one answer, nothing leaks, and the GGUF
    follows HF within 0.02. CI covers the same code in pieces: pair data, the loss, ZeRO-3 at 1 and 2 processes, resume and the reference cache on tiny_dpo,
    and eval.pairs on HF and GGUF (tests/test_preference.py)."""
    summary, _ = _demo_after_smollm2_sft(tmp_path, "smollm2_dpo")
    pref = summary["preference"]
    assert pref["hf_accuracy"] > pref["base_accuracy"], pref  # measured 0.933 -> 0.983: little headroom on the pairs
    assert abs(pref["gguf_accuracy"] - pref["hf_accuracy"]) <= 0.02 and pref["hf_reward_accuracy"] >= 0.8, pref
    task, retention = summary["sets"]["task"], summary["sets"]["retention"]
    assert task["hf"] >= task["base"] + 0.05 and abs(task["gguf"] - task["hf"]) <= 0.02, task  # the held-out gain
    assert retention["hf"] >= retention["base"] - 0.025 - 1e-9, retention  # within one answer of 40
    assert summary["leakage"]["retention"]["hf"] == 0 and summary["leakage"]["retention"]["gguf"] == 0
    assert summary["passed"] is True


@pytest.mark.extended  # the SmolLM2 SFT + GRPO chains; CI: tests/test_grpo.py (tiny_grpo's rollouts, loss, resume)
def test_make_demo_smollm2_grpo(tmp_path):
    """RL with a verifiable reward after SFT on the real model, as `make demo RECIPE=smollm2_grpo` runs it: the SFT run
    first (into tmp_path/sft), then GRPO through the whole chain, rewarded by the task's own scorer, with the KL to
    the SFT model. The held-out task reaches the issue's goal, DPO's 0.933 (measured 0.700 -> 0.950, 2026-11-29, 45
    steps at 3e-5, beta 0.04), retention stays within one answer, nothing leaks, and the GGUF follows HF within 0.02;
    the log reports the rollouts' rewards and the KL. CI covers the same code in pieces: rewards, the
    fused loss against the formula and Liger's, rollouts gathered once or per token, exact resume on tiny_grpo
    (tests/test_grpo.py)."""
    summary, log = _demo_after_smollm2_sft(tmp_path, "smollm2_grpo")
    assert "groups without spread" in log and "rollouts' mean reward" in log and ", KL " in log
    task, retention = summary["sets"]["task"], summary["sets"]["retention"]
    assert task["hf"] >= 0.933 and abs(task["gguf"] - task["hf"]) <= 0.02, task  # the held-out gain: DPO's or more
    assert retention["hf"] >= retention["base"] - 0.025 - 1e-9, retention  # within one answer of 40
    assert summary["leakage"]["retention"]["hf"] == 0 and summary["leakage"]["retention"]["gguf"] == 0
    assert summary["passed"] is True
