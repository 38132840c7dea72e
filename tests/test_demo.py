"""`make demo` end to end: the last line is the JSON summary and it meets the bar in the README.

tiny: full fine-tuning under ZeRO-3 on 2 processes. tiny_qlora: adapters on a 4-bit NF4 base, merged into the
fp32 base, exported to Q8_0 and checked the same way (issue 8's "whole chain on CPU passes its check")."""

import json
import subprocess

import pytest

from test_train_integration import REPO

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("recipe", ["tiny", "tiny_qlora"])
def test_make_demo(tmp_path, recipe):
    proc = subprocess.run(["make", "-s", "demo", f"RECIPE={recipe}", f"ARGS=output_dir={tmp_path}"], cwd=REPO,
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
    if recipe == "tiny_qlora":
        v = json.loads((tmp_path / "train" / "manifest.json").read_text())["verify"]
        assert v["method"] == "qlora"
        assert v["adapter_reload_max_abs_logit_diff"] < 1e-3  # same 4-bit base + reloaded adapter == trained
        assert v["merge_max_abs_logit_diff"] < 1e-3           # merged fp32 model == fp32 base + adapter
        assert v["max_abs_logit_diff"] < 1e-3                 # saved merged model reloads identically
        assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
        assert not list((tmp_path / "model").glob("adapter_*")), "the published model is merged, not an adapter"
        q = json.loads((tmp_path / "gguf" / "manifest.json").read_text())
        assert q["type"] == "q8_0"
