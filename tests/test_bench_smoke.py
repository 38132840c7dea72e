"""The data and inference benchmarks run end to end at a tiny size and write what bench/report.py reads;
this keeps `make bench` from rotting between the (long, manual) full runs. Timings here mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def test_ratio_stats_per_repeat_median_spread():
    from bench_stats import fmt_ratio, ratio_stats

    s = ratio_stats([2.0, 1.0, 4.0])
    assert s == {"per_repeat": [2.0, 1.0, 4.0], "median": 2.0, "spread": 1.5}
    assert fmt_ratio(s) == "2.00x (1.00-4.00x over 3 repeats, spread 150.0%)"


def _run(args: list[str]) -> None:
    p = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.integration  # a subprocess bench: not for `make test-fast`
@pytest.mark.usefixtures("tokenizer_dir")
def test_bench_data_small(tmp_path):
    # seq_len below the longest documents: the exactness check must still compare like with like
    _run(["bench/bench_data.py", "--n", "300", "--baseline-n", "60", "--repeats", "2", "--seq-len", "512",
          "--out", str(tmp_path / "data")])
    res = json.loads((tmp_path / "data.json").read_text())
    assert res["identical_ids_and_labels_on_baseline_subset"] is True
    assert len(res["repeat_runs"]) == 2 and len(res["ratio"]["per_cpu_second"]["per_repeat"]) == 2
    assert res["prepare"]["doc_tokens"] > res["baseline"]["tokens"] > 0
    assert "| repeat |" in (tmp_path / "data.md").read_text()


@pytest.mark.integration
@pytest.mark.extended  # make bench runs this plumbing in full
@pytest.mark.usefixtures("tokenizer_dir")
def test_bench_data_scale_small(tmp_path):
    _run(["bench/bench_data_scale.py", "--n", "3000", "--small", "300", "--seq-len", "2048", "--num-proc", "2",
          "--out", str(tmp_path / "data_scale")])
    res = json.loads((tmp_path / "data_scale.json").read_text())
    small, full = res["runs"]["small"], res["runs"]["full"]
    assert (small["rows"], small["docs"], full["rows"], full["docs"]) == (300, 300, 3000, 3000)
    assert full["peak_main_anon_mb"] > 0 and full["peak_workers_anon_mb"] > 0 and len(full["main_anon_timeline_mb"]) == 4
    assert full["workers_cpu_s"] > 0 and res["rows_per_s_bound_by_main"] > 0
    assert "| all | 3,000 |" in (tmp_path / "data_scale.md").read_text()


@pytest.mark.integration
@pytest.mark.extended  # make bench runs this plumbing in full
@pytest.mark.usefixtures("tokenizer_dir")
def test_bench_inference_small(tmp_path):
    _run(["bench/bench_inference.py", "--model", str(tmp_path / "none"), "--prompt-tokens", "32", "--new-tokens",
          "8", "--repeats", "2", "--prefills", "2", "--decodes", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "inference.json").read_text())
    assert len(res["groups"]) == 2
    for g in res["groups"]:
        for m in ("prompt_tokens_per_s", "decode_tokens_per_s", "prompt_tokens_per_cpu_s", "decode_tokens_per_cpu_s"):
            assert len(g[m]) == (2 if m.startswith("prompt") else 1)
            assert all(set(r) == {"hf", "gguf", "gguf_aa"} and min(r.values()) > 0 for r in g[m])
    assert res["threads"]["hf"]["threads"] == 1 and res["threads"]["gguf"]["threads_batch"] == 1
    assert len(res["a_a_gguf_over_gguf"]["prompt_tokens_per_s"]["per_repeat"]) == 2
    lim = res["of_limit"]  # the fractions of this machine's measured limits (bench_limits.py, same run)
    assert lim["gguf_bytes"] > 0 and lim["forward_flops_per_token"] > 0
    assert all(0 < v < 10 for e in ("gguf", "hf") for v in lim[e].values()), lim
    assert "of the read bandwidth" in (tmp_path / "inference.md").read_text()
    assert "ratio GGUF / HF" in (tmp_path / "inference.md").read_text()


@pytest.mark.integration
@pytest.mark.extended  # make bench runs this plumbing in full
def test_bench_train_small(tmp_path):
    # the padded Trainer on SmolLM2, one measured step: the bench's own plumbing (recipe -> zerotune's prepare and
    # TrainingArguments for the baseline, the probe, the matmul limit) keeps working; zerotune's own training runs
    # through the same CLI in every integration test, so it is left to `make bench` here (CI budget)
    _run(["bench/bench_train.py", "--configs", "trainer_padded", "--steps", "2", "--warmup", "1",
          "--repeats", "1", "--seq-len", "256", "--conversations", "60", "--limit-seconds", "0.05",
          "--out", str(tmp_path / "train")])
    res = json.loads((tmp_path / "train.json").read_text())
    for c in ("trainer_padded",):
        m = res["median"][c]
        assert m["label_tokens_per_s"] > 0 and 0 < m["efficiency"] <= 1, m
        assert 0 < m["of_matmul_limit_cpu_s"] < 1.5, m  # model FLOPs cannot much exceed the measured matmul rate
    assert res["setup"]["recipe_train_section"]["lr"] == 1e-4  # the baselines' hyper-parameters: the recipe's
    assert "of the matmul limit" in (tmp_path / "train.md").read_text()


@pytest.mark.integration
@pytest.mark.extended  # make bench runs it in full; CI checks batched == one at a time in test_answering.py
def test_bench_answers_small(tmp_path):
    _run(["bench/bench_answers.py", "--prompts", "3", "--new-tokens", "4", "--batch", "3", "--repeats", "1",
          "--out", str(tmp_path / "answers")])
    res = json.loads((tmp_path / "answers.json").read_text())
    assert res["identical_answers"] is True and len(res["speedup"]["cpu_s"]["per_repeat"]) == 1
    assert "per CPU-second" in (tmp_path / "answers.md").read_text()


@pytest.mark.integration
@pytest.mark.extended  # make bench runs it in full
def test_bench_rollout_small(tmp_path):
    # both rollout paths (generate() with num_return_sequences, transformers' generate_batch) at a tiny size
    _run(["bench/bench_rollout.py", "--prompts", "1", "--group", "2", "--new-tokens", "3", "--repeats", "1",
          "--out", str(tmp_path / "rollout")])
    res = json.loads((tmp_path / "rollout.json").read_text())
    (size,) = res["sizes"]
    assert size["sequences"] == 2 and set(size["median"]) == {"hf_generate", "generate_batch"}
    assert all(0 < m["tokens"] <= 2 * 3 for m in size["median"].values())
    assert len(size["ratio_generate_batch_over_hf_generate"]["tokens_per_cpu_s"]["per_repeat"]) == 1
    assert "generate_batch / hf_generate" in (tmp_path / "rollout.md").read_text()


def test_history_compares_runs_of_the_same_settings_only(tmp_path):
    import datetime

    import report

    def write(conversations: int, ratio: float) -> None:
        (tmp_path / "data.json").write_text(json.dumps({
            "conversations": conversations, "seq_len": 4096, "num_proc": 2, "repeats": 3,
            "baseline": {"conversations": 100},
            "ratio": {"wall_tokens_per_s": {"median": ratio}, "per_cpu_second": {"median": ratio / 2},
                      "baseline_a_a": {"median": 1.0}}}))
        (tmp_path / "train.json").write_text(json.dumps({"setup": {"steps": 5}, "ratio_vs_trainer_padded": {}}))
        (tmp_path / "inference.json").write_text(json.dumps({"prompt_tokens": 256}))

    write(1000, 9.0)  # other settings: listed, not counted
    report.history(tmp_path)
    write(2000, 6.0)
    report.history(tmp_path)
    write(2000, 6.6)
    md = report.history(tmp_path)
    assert report.history(tmp_path) == md  # the same results are not appended twice
    rows = [x for x in md.splitlines() if x.startswith(f"| {datetime.date.today()}")]
    assert len(rows) == 3 and "*" not in rows[0].split("|")[1] and all("*" in r.split("|")[1] for r in rows[1:])
    spread = next(x for x in md.splitlines() if x.startswith("| **spread"))
    assert "| 9.5% |" in spread  # data, wall: (6.6 - 6.0) / median(6.0, 6.6) = 9.5%, within 10%; 9.0 not counted
    assert "the 2 run(s) marked" in md
    write(2000, 7.5)
    spread = next(x for x in report.history(tmp_path).splitlines() if x.startswith("| **spread"))
    assert "| 22.7% (over) |" in spread  # (7.5 - 6.0) / median 6.6
