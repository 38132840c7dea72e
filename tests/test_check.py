"""check: T4 fit arithmetic (pure), and the GGUF against the HF model it came from (integration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotune.answering import gguf_answers, load_gguf
from zerotune.check import logit_agreement, speed, t4_fit
from zerotune.hardware import GPUS, LLAMA_CPP_OVERHEAD_GIB

T4_USABLE_GIB, T4_OVERHEAD_GIB = GPUS["t4"].usable_gib, LLAMA_CPP_OVERHEAD_GIB

REPO = Path(__file__).resolve().parents[1]
KL_TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest to find its den.",
    "Repeat after me: red cat apple. You said: red cat apple. Repeat after me: blue dog chair.",
    "Größenwahn, café, naïve façade — déjà vu. 日本語のテキストと中文文本。Привет, как дела?",
    "def f(x):\n    return x ** 2 + 3 * x - 7\n\nprint([f(i) for i in range(10)])",
]


def test_t4_fit_llama31_8b_q8_0():
    cfg = json.loads((REPO / "configs" / "models" / "llama31_8b.json").read_text())
    res = t4_fit(8_540_000_000, cfg, 8192)  # the 8B Q8_0 file: 8.54 GB = 7.95 GiB
    assert res["kv_cache_kib_per_token"] == 128  # 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert res["weights_gib"] == pytest.approx(7.95, abs=0.01)
    assert res["needed_gib"] == pytest.approx(7.954 + 1.0 + T4_OVERHEAD_GIB, abs=0.01)  # 1 GiB KV at 8K
    assert res["fits"] is True
    expected_max = int((T4_USABLE_GIB - 8_540_000_000 / 2**30 - T4_OVERHEAD_GIB) * 2**30 // (128 * 1024))
    assert res["max_context_that_fits"] == expected_max and 45_000 < expected_max < 55_000
    assert t4_fit(8_540_000_000, cfg, 131072)["fits"] is False  # the full 128K context does not fit
    # A file larger than the T4: nothing fits, and the largest context is 0, not negative.
    big = t4_fit(16 * 2**30, cfg, 8192)
    assert big["fits"] is False and big["max_context_that_fits"] == 0


def test_t4_fit_head_dim_defaults_to_hidden_over_heads():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "max_position_embeddings": 1024}
    res = t4_fit(10 * 2**20, cfg, 256)
    assert res["kv_cache_kib_per_token"] == 2 * 2 * 4 * 16 * 2 / 1024  # no GQA: KV heads = attention heads
    assert res["max_context_that_fits"] == 1024  # capped by the model's own maximum


@pytest.mark.parametrize("hf,gguf,failed", [(0.1, 0.1, []), (0.1, 0.11, ["GGUF"]), (0.2, 0.1, ["fine-tuned HF"]),
                                             (1.0, 1.0, ["fine-tuned HF", "GGUF"])])
def test_max_leakage_gates_hf_and_gguf_not_the_base(hf, gguf, failed):
    from zerotune.answering import set_failures
    from zerotune.config import EvalSetCfg

    es = EvalSetCfg(name="retention", path="r.jsonl", scorer="contains", max_leakage=0.1)
    scores = {"base": 0.8, "hf": 0.8, "gguf": 0.8}
    got = set_failures(es, scores, {"base": 1.0, "hf": hf, "gguf": gguf})
    measured = {"fine-tuned HF": hf, "GGUF": gguf}
    assert got == [f"retention: {m} answers {measured[m]:.3f} of the set in the task's format, more than 0.1 "
                   f"(eval.sets[retention].max_leakage): the fine-tune leaks its format" for m in failed]
    assert set_failures(EvalSetCfg(name="retention", path="r.jsonl"), scores, {"base": 1.0, "hf": 1.0, "gguf": 1.0}) == []
    assert set_failures(es, scores, None) == []  # not measured (the task set): nothing to gate


def test_check_writes_leakage_and_fails_past_max_leakage(tmp_path, monkeypatch, capsys):
    """check's own path with the models faked: answers (score_models), the GGUF and the logit comparison."""
    import zerotune.check as ck
    from zerotune.config import load_recipe
    from zerotune.layout import layout

    for name in ("task", "retention"):
        (tmp_path / f"{name}.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}], "answer": "a"}\n')
    r = load_recipe("tiny", [f"output_dir={tmp_path / 'run'}", "data.heldout=null",
                             f"eval.sets=[{{name: task, path: {tmp_path / 'task.jsonl'}, scorer: json_fields}}, "
                             f"{{name: retention, path: {tmp_path / 'retention.jsonl'}, scorer: contains, "
                             f"max_leakage: 0.0}}]"])
    paths = layout(r)
    paths.model.mkdir(parents=True)
    (paths.model / "config.json").write_text((REPO / "configs" / "models" / "tiny_llama31.json").read_text())
    paths.gguf.parent.mkdir(parents=True)
    paths.gguf.write_bytes(b"GGUF")
    one = {"answers": ["a"], "finish": ["stop"], "seconds": 1.0, "per_row": [1.0]}
    leak = {"base": 0.0, "hf": 0.0, "gguf": 1.0}
    scored = {"task": {m: {**one, "score": 1.0, "leakage": None} for m in leak},
              "retention": {m: {**one, "score": 1.0 - v, "leakage": v} for m, v in leak.items()}}

    class FakeLlama:
        def close(self):
            pass

    monkeypatch.setattr(ck, "read_header", lambda path: None)
    monkeypatch.setattr(ck, "score_models", lambda r, sets, rows: {"models": {}, "sets": scored})
    monkeypatch.setattr(ck, "load_gguf", lambda *a, **k: FakeLlama())
    monkeypatch.setattr(ck, "heldout_documents", lambda r, limit: [])
    monkeypatch.setattr(ck, "logit_agreement", lambda llm, model_dir, docs: {
        "documents": 0, "positions": 0, "mean_kl": None, "top1_agreement": 1.0, "label_positions": 0,
        "top1_agreement_labels": None, "top1_near_tie_agreement": 1.0, "top1_near_tie_agreement_labels": None,
        "tie_nats": 0.1, "ppl_ratio": 1.0})
    monkeypatch.setattr(ck, "speed", lambda llm: {"prompt_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0})
    assert ck.check(r) == 1
    res = json.loads((tmp_path / "run" / "check" / "check.json").read_text())
    assert res["sets"]["task"]["leakage"] is None
    assert res["sets"]["retention"]["leakage"] == leak and res["sets"]["retention"]["max_leakage"] == 0.0
    assert res["failures"] == ["retention: GGUF answers 1.000 of the set in the task's format, more than 0.0 "
                               "(eval.sets[retention].max_leakage): the fine-tune leaks its format"]
    out = capsys.readouterr().out
    assert "answers in the task's format (leakage, scored 0): base 0.000 | HF 0.000 | GGUF 1.000 (max 0.0)" in out
    assert json.loads(out.strip().splitlines()[-1])["leakage"] == {"retention": leak}


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    llm = load_gguf(tiny_gguf, n_ctx=512)
    yield llm
    llm.close()


@pytest.mark.integration
def test_logit_agreement_q8_0_vs_hf(llm, tiny_model_dir, tokenizer):
    docs = [tokenizer(t)["input_ids"] for t in KL_TEXTS]
    res = logit_agreement(llm, tiny_model_dir, docs)
    print(f"\nQ8_0 vs HF: {res}")
    assert res["positions"] == sum(len(d) for d in docs)
    assert res["mean_kl"] <= 0.01
    # The random model's distributions are near-flat (median top-1/top-2 margin ~0.1 nats): Q8_0 noise flips
    # argmaxes between near-ties (~10% of positions) while KL stays tiny. Demand 0.98 where ties are resolved.
    assert res["top1_near_tie_agreement"] >= 0.98
    assert res["top1_agreement"] >= 0.8
    assert res["ppl_ratio"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.integration
def test_logit_agreement_needs_all_logits(tiny_gguf, tiny_model_dir):
    last_only = load_gguf(tiny_gguf, n_ctx=64, logits_all=False)
    try:
        with pytest.raises(ValueError, match="logits_all"):
            logit_agreement(last_only, tiny_model_dir, [[128000, 9906, 1917]])
    finally:
        last_only.close()


@pytest.mark.integration
def test_gguf_answers_use_the_embedded_chat_template(llm, tiny_model_dir):
    """A random model need not stop, so check the prompt instead: the tokens the GGUF is fed for a chat are
    exactly HF's apply_chat_template tokens (what training used), whitespace-trimming included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [{"messages": [{"role": "user", "content": "Repeat after me: red cat apple"}], "answer": "x"},
            {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "  padded\nquestion  "}], "answer": "y"}]
    prompts = []
    real = llm.create_completion

    def spy(prompt, *a, **k):
        prompts.append(list(prompt))
        return real(prompt, *a, **k)

    llm.create_completion = spy
    try:
        answers, reasons = gguf_answers(llm, rows, max_new_tokens=4)
    finally:
        del llm.create_completion
    assert len(prompts) == len(rows) and len(answers) == len(rows)
    for row, got in zip(rows, prompts):
        want = list(tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"])
        assert got == want, (tok.decode(got), tok.decode(want))
    assert all(r in ("stop", "length") for r in reasons)


@pytest.mark.integration
def test_speed_reports_positive_rates(llm):
    res = speed(llm, n_prompt=32, n_decode=8)
    print(f"\ntiny Q8_0 on this machine: {res}")
    assert res["prompt_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0


def test_t4_decode_prediction_and_the_measured_figure_beside_its_ceiling():
    """Issue 53 (7): decode on a T4 is memory-bound, every token reading the whole GGUF: predicted = 320 GB/s over its
    bytes x llama.cpp's efficiency measured here (its decode x bytes over this machine's read rate); on a GPU run
    (check_t4.sbatch) the measured figure beside that ceiling. Llama-3.1-8B's Q8_0 (8.54 GB): ceiling 37.5 tok/s."""
    import zerotune.check as ck

    gguf = 8_532_152_576
    cpu = ck.t4_decode(gguf, decode_tokens_per_s=2.0, on_gpu=False, bandwidth=20e9)
    assert cpu["ceiling_tokens_per_s"] == pytest.approx(320e9 / gguf, abs=0.05)
    assert cpu["efficiency_here"] == pytest.approx(2.0 * gguf / 20e9, rel=1e-3)  # 0.85 of this machine's read rate
    assert cpu["predicted_tokens_per_s"] == pytest.approx(320e9 / gguf * 2.0 * gguf / 20e9, rel=1e-2)  # = 32 tok/s
    line = ck._t4_decode_line(cpu)
    assert "predicted ~32.0 tok/s = 320 GB/s / 8.53 GB per token (37.5 ceiling) x llama.cpp's efficiency here 0.85" in line
    gpu = ck.t4_decode(gguf, decode_tokens_per_s=30.0, on_gpu=True, bandwidth=None)
    assert gpu["measured_tokens_per_s"] == 30.0 and gpu["of_ceiling"] == pytest.approx(0.8, abs=0.01)
    assert "measured 30.0 tok/s on this GPU; ceiling 320 GB/s / 8.53 GB per token = 37.5 (80% of it)" in \
        ck._t4_decode_line(gpu)
    assert ck.read_bandwidth(nbytes=1 << 24, repeats=1) > 1e8  # a real reading, bytes per second
