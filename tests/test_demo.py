"""`make demo` end to end: the last line is the JSON summary and it meets the bar in the README."""

import json
import subprocess

import pytest

from test_train_integration import REPO

pytestmark = pytest.mark.integration


def test_make_demo(tmp_path):
    proc = subprocess.run(["make", "-s", "demo", "RECIPE=tiny", f"ARGS=output_dir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["base_accuracy"] <= 0.1
    assert summary["hf_accuracy"] >= 0.9 and summary["gguf_accuracy"] >= 0.9
    assert abs(summary["hf_accuracy"] - summary["gguf_accuracy"]) <= 0.02
    assert summary["passed"] is True
    check = json.loads((tmp_path / "check" / "check.json").read_text())
    assert check["agreement"]["mean_kl"] <= 0.01 and check["agreement"]["top1_gated"] >= 0.98
