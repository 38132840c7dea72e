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


@pytest.mark.usefixtures("tokenizer_dir")
def test_bench_inference_small(tmp_path):
    _run(["bench/bench_inference.py", "--model", str(tmp_path / "none"), "--prompt-tokens", "32", "--new-tokens",
          "8", "--repeats", "2", "--prefills", "2", "--decodes", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "inference.json").read_text())
    for engine in ("hf", "gguf"):
        assert len(res["runs"][engine]) == 2
        assert all(r["prompt_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in res["runs"][engine])
    assert res["runs"]["hf"][0]["threads"] == 1 and res["runs"]["gguf"][0]["threads_batch"] == 1
    assert "ratio GGUF / HF" in (tmp_path / "inference.md").read_text()
