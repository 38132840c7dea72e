"""scripts/gpu_check.py (the GPU acceptance kit): every part that runs without a GPU.

The GPU branch itself needs a CUDA device; here: the no-GPU exit, argument parsing, the table, the 1B-shaped
config (meta device), the planner lookup that fills the predicted column, the DeepSpeed "auto" filling of the
fp16 check, and the packed-vs-per-document comparison of the SDPA check (fp32 on CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_cuda_prints_one_line_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device even on a GPU machine
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("gpu_check: no CUDA device: nothing to check")
    for what in ("fp16", "DeepSpeed ZeRO-3", "SDPA", "Liger", "Llama-3.2-1B", "2048, 4096", "resume"):
        assert what in lines[0]  # says what it would check
    assert not out.exists()


def test_parse_args_defaults_and_choices(gc):
    a = gc.parse_args([])
    assert a.seq == [2048, 4096]
    assert a.checks == ["fp16_loss_scale", "sdpa_packed", "liger", "liger_families", "zero3_1b"]
    assert a.steps == 3 and a.timeout == 1800 and not a.force and a.worker is None
    assert a.out == REPO / "runs" / "gpu_check" / "gpu_check.json"
    a = gc.parse_args(["--seq", "4096", "--checks", "liger, zero3_1b", "--out", "x.json", "--steps", "5",
                       "--force", "--tmpdir", "/scratch"])
    assert a.seq == [4096] and a.checks == ["liger", "zero3_1b"] and a.out == Path("x.json")
    assert a.steps == 5 and a.force and a.tmpdir == "/scratch"
    for bad in (["--seq", "63"], ["--seq", "2049"], ["--checks", "bogus"], ["--checks", ""], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)


def test_table_renders_rows(gc):
    GiB = 1024 ** 3
    rows = [
        gc.make_row("1B seq 2048: train", "ok", "fp16, 3 steps", allocated=int(20.5 * GiB), reserved=24 * GiB,
                    seconds=2.345, predicted_allocated=20 * GiB, predicted_reserved=int(25.8 * GiB)),
        gc.make_row("flash_attention_2 packed (varlen)", "skipped", "sm70: FlashAttention 2 needs sm80+"),
        gc.make_row("liger eval skip_logits (no logits)", "FAIL", "RuntimeError: boom", allocated=GiB // 4,
                    reserved=GiB // 2, seconds=0.01),
    ]
    text = gc.format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].split()[:2] == ["check", "status"] and "pred alloc" in lines[0] and lines[0].endswith("detail")
    assert set(lines[1].replace(" ", "")) == {"-"}
    train, fa2, liger = lines[2:]
    assert "20.50" in train and "24.00" in train and "20.00" in train and "25.80" in train and "1.02" in train
    assert "2.35" in train and train.endswith("fp16, 3 steps")
    assert " skipped " in fa2 and fa2.count(" - ") >= 6 and fa2.endswith("needs sm80+")
    assert " FAIL " in liger and "0.25" in liger and "0.50" in liger and liger.endswith("RuntimeError: boom")
    # columns line up: every row's status starts where the header's does
    col = lines[0].index("status")
    assert all(line[col:].split()[0] in ("ok", "FAIL", "skipped") for line in lines[2:])
    with pytest.raises(AssertionError):
        gc.make_row("x", "passed")


def test_header_names_card_memory_and_versions(gc):
    info = {"name": "Tesla V100-SXM2-32GB", "capability": [7, 0], "total_memory": 34087305216, "device_count": 8,
            "cuda": "12.6", "arch_list": ["sm_70", "sm_80"], "versions": {"torch": "2.13.0+cu126", "deepspeed": "0.19.8"}}
    text = "\n".join(gc.header_lines(info))
    assert "Tesla V100-SXM2-32GB" in text and "sm70" in text and "31.75 GiB" in text and "34,087,305,216" in text
    assert "torch 2.13.0+cu126" in text and "CUDA 12.6" in text and "deepspeed 0.19.8" in text


def test_1b_shaped_config_on_meta_device(gc):
    cfg = gc.llama32_1b_config()
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (2048, 8192, 16, 32, 8, 128256)
    assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    # by hand: tied embeddings 128,256 x 2,048; per layer q, o 2,048^2, k, v 2,048 x 512, gate/up/down 2,048 x 8,192,
    # two norms; 16 layers; final norm
    head_dim = 2048 // 32
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 8 * head_dim + 3 * 2048 * 8192 + 2 * 2048
    expected = 128256 * 2048 + 16 * per_layer + 2048
    assert per_layer == 60_821_504 and expected == 1_235_814_400 == gc.LLAMA32_1B_PARAMS
    assert gc.meta_param_count(cfg) == expected


def test_plan_gpu_key(gc):
    assert gc.plan_gpu_key((7, 0), "Tesla V100-SXM2-32GB") == "v100-32gb"
    assert gc.plan_gpu_key((7, 5), "Tesla T4") == "t4"
    assert gc.plan_gpu_key((8, 0), "NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gc.plan_gpu_key((9, 0), "NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert gc.plan_gpu_key((9, 0), "NVIDIA H200") == "h100-80gb"  # unlisted card: same capability
    assert gc.plan_gpu_key((8, 9), "NVIDIA L4") == "a100-80gb"  # bf16 and Liger's sm80+ path
    assert gc.plan_gpu_key((6, 0), "Tesla P100") == "v100-32gb"


def test_prediction_for_the_1b_check(gc):
    v100 = gc.predict_1b(2048, (7, 0), "Tesla V100-SXM2-32GB")
    assert v100["plan_gpu"] == "v100-32gb" and v100["precision"] == "fp16"
    assert v100["model_params"] == gc.LLAMA32_1B_PARAMS
    assert set(v100["phases"]) == set(gc.PHASES)
    alloc, reserved, peak = v100["phases"]["train"]
    # at least the model states (16 B/param on one GPU); reserved >= allocated; the peak adds the CUDA context
    assert 16 * gc.LLAMA32_1B_PARAMS < alloc <= reserved and alloc < peak == v100["peak_bytes"]
    if v100["has_phase_model"]:  # planner/phases.py: every GPU phase has allocated <= reserved and a peak above it
        for phase in gc.PHASES[1:]:
            a, r, p = v100["phases"][phase]
            assert 16 * gc.LLAMA32_1B_PARAMS < a <= r and a < p, phase
    else:  # without it only the training step is predicted
        assert all(v100["phases"][p] == (None, None, None) for p in gc.PHASES[1:])
    longer = gc.predict_1b(4096, (7, 0), "Tesla V100-SXM2-32GB")
    assert longer["phases"]["train"][0] > alloc
    h100 = gc.predict_1b(2048, (9, 0), "NVIDIA H100 80GB HBM3")
    assert h100["precision"] == "bf16" and h100["plan_gpu"] == "h100-80gb"


def test_phase_predictions_read_the_planners_phases(gc):
    from zerotune.planner import calibration

    GiB = 1024 ** 3
    tensors = {"model states (DeepSpeed estimator)": 20 * GiB, "reduce bucket": GiB}
    gpu = {**tensors, **calibration.overheads(21 * GiB, world=1, gpu_is_cuda=True)}
    phases = {"train_step": {"peak_bytes": 30 * GiB, "limit": "gpu", "parts": gpu},
              "save": {"peak_bytes": sum(gpu.values()), "limit": "gpu", "parts": gpu},
              "save_host": {"peak_bytes": 5 * GiB, "limit": "host", "parts": {"x": 5 * GiB}},
              "resume_host": {"peak_bytes": 5 * GiB, "limit": "host", "parts": {"x": 5 * GiB}},
              "finalize": {"peak_bytes": 9, "limit": "host", "parts": {"x": 9}}}
    got = gc.phase_predictions(phases)
    assert set(got) == {"train", "save"}  # host phases are not this GPU's
    alloc, reserved, peak = got["save"]
    assert alloc == 21 * GiB  # tensors only: what max_memory_allocated sees
    assert reserved == calibration.views(alloc, gpu)["reserved"] and peak == sum(gpu.values())
    # other shapes: views given, plain numbers, a list of named phases
    assert gc.phase_predictions({"validation": {"views": {"allocated": 7, "reserved": 9}, "peak_bytes": 11}}) == \
        {"validation": (7, 9, 11)}
    assert gc.phase_predictions([{"name": "resume", "peak_bytes": 5}, {"phase": "samples", "views": {"allocated": 3}}]) \
        == {"resume": (5, None, 5), "samples": (3, None, None)}
    assert gc.phase_predictions(None) == {}


def test_too_big_skips_only_what_the_planner_says_does_not_fit(gc):
    expect = {"peaks": {"train": 20, "resume": 40}, "total": 32, "force": False}
    assert gc._too_big("train", expect) is None
    assert "predicts" in gc._too_big("resume", expect) and "--force" in gc._too_big("resume", expect)
    assert gc._too_big("validation", expect) is None  # no prediction: run it
    assert gc._too_big("resume", {**expect, "force": True}) is None


def test_fp16_check_config_has_no_auto_left(gc):
    from zerotune import batch as batchmod
    from zerotune import ds_config
    from zerotune.config import from_dict

    r = from_dict({"name": "t", "model": {"init_config": "configs/models/tiny_llama31.json"},
                   "data": {"seq_len": 128}, "train": {"global_batch_tokens": 128, "deepspeed": gc.ZERO3_JSON}})
    ds = ds_config.build(r, batchmod.derive(128, 128, 1, 1), 100)
    cfg = gc.fill_trainer_autos(ds, micro=1, grad_accum=1, world=1, hidden=256, precision="fp16", max_grad_norm=1.0)
    assert "auto" not in json.dumps(cfg)
    assert cfg["fp16"]["enabled"] is True and cfg["bf16"]["enabled"] is False
    assert cfg["fp16"]["initial_scale_power"] == 16 and cfg["fp16"]["hysteresis"] == 2  # what the check expects
    assert cfg["train_batch_size"] == 1 and cfg["gradient_clipping"] == 1.0
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["reduce_bucket_size"] == 256 * 256 and z["stage3_param_persistence_threshold"] == 2560
    assert "auto" in json.dumps(ds)  # the input is left as it was


def test_packed_rows_restart_positions(gc):
    rows = gc.packed_rows(3, 64, 1024, seed=0)
    assert len(rows) == 3 and rows == gc.packed_rows(3, 64, 1024, seed=0)  # deterministic
    r = rows[0]
    assert len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"]) == 64
    assert r["position_ids"][:3] == [0, 1, 2] and r["position_ids"][48:50] == [0, 1]
    assert r["labels"][:8] == [-100] * 8 and r["labels"][48:56] == [-100] * 8 and r["labels"][8] == r["input_ids"][8]


def test_packed_logits_equal_per_document_on_cpu(gc):
    """The comparison the SDPA check runs in fp16 on the GPU, in fp32 on CPU: the block-causal mask from restarting
    position_ids keeps documents apart, and the control (no position_ids) shows the comparison would see a leak."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gc.tiny_llama_config(init=0.1), dtype=torch.float32,
                                             attn_implementation="sdpa").train()
    res = gc.packed_vs_documents(model, (40, 56), 1024, "cpu")
    assert res["max_diff"] <= res["tol"], res
    assert res["control_diff"] > 10 * res["tol"], res


def test_crash_reason(gc):
    err = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB\n"
    assert gc.crash_reason(1, err).endswith("torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB")
    assert "signal 9: killed, host out of memory?" in gc.crash_reason(-9, "")


def test_sdpa_backend_detection_on_cpu(gc):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gc.tiny_llama_config(), dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(2, 1024, (1, 64))
    pos = torch.cat([torch.arange(40), torch.arange(24)]).unsqueeze(0)
    with sdpa_kernel([SDPBackend.MATH]):
        assert gc.sdpa_backends_used(lambda: model(input_ids=ids, position_ids=pos, use_cache=False)) == ["math"]
    assert gc.sdpa_backends_used(lambda: model(input_ids=ids, position_ids=pos, use_cache=False))  # names a backend


V100_INFO = {"name": "Tesla V100-SXM2-32GB", "capability": [7, 0], "total_memory": 34087305216, "device_count": 1,
             "cuda": "12.6", "arch_list": ["sm_70"], "versions": {"torch": "2.13.0+cu126"}}


@pytest.mark.parametrize("force", [False, True])
def test_gpu_branch_orchestration_with_fake_workers(gc, tmp_path, monkeypatch, capsys, force):
    """The parent's GPU branch with the worker processes replaced: rows, predictions, per-phase skips, the resume
    handed the checkpoint and fingerprint, the JSON, and exit 1 on a FAIL."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def fake(name, a, extra, label, log_dir):
        calls.append((name, extra))
        if name == "env":
            return {"rows": [], "info": V100_INFO}
        if name == "zero3_1b":
            seq = extra[extra.index("--seq") + 1]
            return {"rows": [gc.make_row(f"1B seq {seq}: {p}", "ok", p, allocated=2**34, reserved=2**35, seconds=1.0)
                             for p in gc.PHASES[:4]],
                    "info": {"saved": True, "checkpoint": "/x/checkpoint-3", "fingerprint": {"step": 3}}}
        if name == "zero3_1b_resume":
            return {"rows": [gc.make_row("zero3_1b_resume", "ok", "equal", allocated=2**34, reserved=2**35)]}
        if name == "liger":
            return {"rows": [gc.make_row("liger kernels, train loss/grads (fp16)", "FAIL", "boom")]}
        return {"rows": [gc.make_row(name, "ok", "fine")]}

    monkeypatch.setattr(gc, "run_worker", fake)
    out = tmp_path / "r.json"
    rc = gc.main(["--seq", "2048", "--out", str(out)] + (["--force"] if force else []))
    assert rc == 1  # the liger FAIL
    text = capsys.readouterr().out
    assert "Tesla V100-SXM2-32GB (sm70" in text and "31.75 GiB" in text and "1 failed" in text
    res = json.loads(out.read_text())
    rows = {r["check"]: r for r in res["rows"]}
    assert res["failed"] == 1 and res["device"]["name"] == "Tesla V100-SXM2-32GB"
    assert [c for c, _ in calls][:4] == ["env", "fp16_loss_scale", "sdpa_packed", "liger"]
    pred = gc.predict_1b(2048, (7, 0), "Tesla V100-SXM2-32GB")
    train = rows["1B seq 2048: train"]
    assert train["predicted_allocated_bytes"] == pred["phases"]["train"][0] and "plan gpu v100-32gb" in train["detail"]
    expect = json.loads(dict(calls)["zero3_1b"][-1])  # what the 1B worker is told
    assert expect["total"] == V100_INFO["total_memory"] and expect["force"] is force
    assert expect["peaks"]["train"] == pred["peak_bytes"]
    resume = rows["1B seq 2048: resume"]
    if pred["phases"]["resume"][2] and pred["phases"]["resume"][2] > V100_INFO["total_memory"] and not force:
        assert resume["status"] == "skipped" and "predicts" in resume["detail"]
        assert "zero3_1b_resume" not in dict(calls)
    else:
        assert resume["status"] == "ok"
        handed = json.loads(dict(calls)["zero3_1b_resume"][-1])
        assert handed["checkpoint"] == "/x/checkpoint-3" and handed["fingerprint"] == {"step": 3}
    assert (tmp_path / "logs").is_dir()


def test_worker_process_protocol(gc, tmp_path, monkeypatch):
    """A real worker process: its failure comes back as a FAIL row with the one-line reason, its log is kept."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    a = gc.parse_args(["--timeout", "300"])
    payload = gc.run_worker("env", a, [], "env", tmp_path)
    (row,) = payload["rows"]
    assert row["check"] == "env" and row["status"] == "FAIL" and "\n" not in row["detail"]
    assert "CUDA" in row["detail"] or "cuda" in row["detail"]
    log = (tmp_path / "env.log").read_text()
    assert "--worker env" in log and gc.ROW_MARK in log


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_family_liger_config_reaches_the_block_rmsnorm_kernel(gc, family):
    """The family Liger check's shape sends the q norm through Liger's block RMSNorm kernel (n_cols <= 256 and
    n_rows >= 4096 * 8 in liger_kernel/ops/rms_norm.py), as Qwen3-8B's and Gemma 3's q/k norms at 8K do."""
    import inspect

    from liger_kernel.ops import rms_norm

    from zerotune.families import FAMILIES, of_config

    cfg = gc.family_config(family)
    assert of_config(cfg).name == family and cfg.head_dim == 128
    assert cfg.num_attention_heads * 4096 >= 4096 * 8  # the check's seq is 4096
    assert "n_rows < 4096 * 8" in inspect.getsource(rms_norm)  # the threshold this shape is sized for
    assert FAMILIES[family].liger_kernels["rms_norm"] and "liger_families" in gc.CHECKS
