"""scripts/gpu_check.py + gpu_check_worker.py (the GPU acceptance kit) and zerotune/emulation.py: every part that
runs without a GPU.

Stated cards: the V100 emulation is computed for an H200 (capability 9.0, 150,109,880,320 bytes as PyTorch
reported it on the lent card, bench/results/gpu_check/h200_2026-11-26.log), an H100 and a V100 itself. The
capability patch and the SDPA guard run here on CPU (no efficient kernel on CPU: every call under EFFICIENT_ATTENTION
is one the guard must catch). The planner's rows for the 8B slice and the parent's orchestration run for real; the
worker processes are faked, except one that answers without a GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
GiB = 1024 ** 3
H200 = ((9, 0), 150_109_880_320, "NVIDIA H200")
H100 = ((9, 0), 84_935_999_488, "NVIDIA H100 80GB HBM3")
V100 = ((7, 0), 34_087_305_216, "Tesla V100-SXM2-32GB")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # the worker imports the parent by this name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc():
    return _load("gpu_check")


@pytest.fixture(scope="module")
def gw(gc):
    return _load("gpu_check_worker")


# --- command line -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_without_cuda_prints_one_line_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device even on a GPU machine
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device: nothing to check"), proc.stdout
    for what in ("as a V100", "fp16", "DeepSpeed ZeRO-3", "sdpa_docs", "Liger", "Llama-3.1-8B", "16384, 512", "resume"):
        assert what in lines[0]
    assert not (tmp_path / "out").exists()


def test_command_line(gc):
    a = gc.parse_args([])
    assert a.target == "v100-32gb" and a.seq == [16384, 512] and a.steps == 3 and not a.quick
    assert a.checks == ["fp16_loss_scale", "sdpa_packed", "liger", "liger_families", "attention_ab", "zero3_8b",
                        "sp_attention"]
    assert a.out == REPO / "runs" / "gpu_check" and a.timeout == 900
    quick = gc.parse_args(["--quick"])
    assert quick.quick and "liger_families" not in quick.checks and "zero3_8b" in quick.checks
    a = gc.parse_args(["--as", "native", "--checks", "zero3_1b, liger", "--seq", "2048", "4096", "--out", "x",
                       "--steps", "5", "--tmpdir", "/scratch"])
    assert a.target == "native" and a.checks == ["zero3_1b", "liger"] and a.seq == [2048, 4096]
    assert a.out == Path("x") and a.steps == 5 and a.tmpdir == "/scratch"
    assert gc.parse_args(["--as", "t4"]).target == "t4"
    for bad in (["--seq", "100"], ["--seq", "2050"], ["--checks", "bogus"], ["--checks", ""], ["--steps", "0"],
                ["--as", "a100-80gb"], ["--as", "h200"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)


# --- the emulation --------------------------------------------------------------------------------------------------

def test_v100_emulation_settings_for_an_h200_and_an_h100():
    from zerotune import hardware
    from zerotune.emulation import emulation_for
    from zerotune.planner.calibration import CUDA_CONTEXT_BYTES

    for cap, total, name in (H200, H100):
        e = emulation_for("v100-32gb", cap, total, name)
        cap_bytes = int(31.75 * GiB) - CUDA_CONTEXT_BYTES  # the V100's usable memory less the planner's context
        assert e.allocator_bytes == cap_bytes and e.fraction == pytest.approx(cap_bytes / total)
        assert e.capability == (7, 0) and e.sdpa == ("EFFICIENT_ATTENTION",) and e.arch == "9.0"
        assert e.gpu is hardware.GPUS["v100-32gb"] and not e.gpu.bf16 and not e.gpu.flash_attention_2
        c = hardware.choose(e.gpu, fa2_installed=True)  # zerotune's own choice for the card emulated
        assert (c.precision, c.attention, c.liger) == ("fp16", "sdpa_docs", True)
        text = " ".join(e.emulated)
        assert "30.85 GiB" in text and "EFFICIENT_ATTENTION only" in text and "(7, 0)" in text
        assert "sm90" in " ".join(e.not_emulated) and "989.0 vs 125.0" in " ".join(e.not_emulated)
    assert emulation_for("v100-32gb", *H200).fraction == pytest.approx(0.2207, abs=1e-4)


def test_emulation_on_the_card_itself_native_and_too_small():
    from zerotune.emulation import EmulationError, emulation_for

    v100 = emulation_for("v100-32gb", *V100)  # 31.747 GiB: the card itself, nothing to cap or patch
    assert v100.fraction is None and v100.allocator_bytes is None and v100.arch is None
    assert v100.capability == (7, 0) and v100.sdpa == ("EFFICIENT_ATTENTION",)  # the math fallback stays visible
    native = emulation_for("native", *H200)
    assert native.gpu_key == "h200" and native.sdpa == () and native.fraction is None and native.capability == (9, 0)
    assert emulation_for("native", (8, 9), 24 * GiB, "NVIDIA L4").gpu_key == "a100-80gb"  # unlisted: bf16 sm80+
    assert emulation_for("t4", *H200).allocator_bytes == int(14.56 * GiB) - int(0.9 * GiB)
    with pytest.raises(EmulationError, match="smaller than a V100.*--as native"):
        emulation_for("v100-32gb", (8, 9), 24 * GiB, "NVIDIA L4")
    with pytest.raises(EmulationError, match="only cards below sm80"):
        emulation_for("a100-80gb", *H200)


def test_h200_entry_and_card_keys():
    from zerotune import hardware
    from zerotune.emulation import card_key

    h200 = hardware.GPUS["h200"]
    assert (h200.capability, h200.peak_tflops, h200.usable_gib, h200.fp32_tflops) == ((9, 0), 989.0, 139.80, 67.0)
    assert h200.bf16 and h200.flash_attention_2 and h200.cluster == hardware.GPUS["h100-80gb"].cluster
    assert round(H200[1] / GiB, 2) == h200.usable_gib  # as measured on the lent card
    assert card_key(*H200[::2]) == "h200" and card_key(*H100[::2]) == "h100-80gb"
    assert card_key(*V100[::2]) == "v100-32gb" and card_key((8, 9), "NVIDIA L4") is None and card_key(None) == "cpu"


def test_emulate_forces_liger_below_sm80_branches_and_restores(monkeypatch):
    """Liger's fused linear cross entropy reads the capability where it accumulates the lm_head gradient
    (liger_kernel 0.8.5 ops/fused_linear_cross_entropy.py:326-330 and :348-352, else the fallback at :367-371), and
    liger_kernel/utils.py:95-97 names the architecture from it: inside emulate() both see a V100."""
    import torch
    from liger_kernel import utils as lutils
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    from zerotune.emulation import emulate, emulation_for

    src = inspect.getsource(flce)
    assert src.count("torch.cuda.get_device_capability(grad_weight.device)[0] >= 8") == 2  # the branches forced
    assert "torch.cuda.get_device_capability(device_id)" in inspect.getsource(lutils._infer_nvidia_arch)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    before = (torch.cuda.get_device_capability, torch.cuda.is_bf16_supported)
    with emulate(emulation_for("v100-32gb", *H200)) as guard:
        assert torch.cuda.get_device_capability() == (7, 0) and torch.cuda.get_device_capability("cuda:0") == (7, 0)
        assert not torch.cuda.is_bf16_supported()
        assert lutils._infer_nvidia_arch(0) == "volta_turing"
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"  # a JIT build targets the real card
        assert guard.backends == ("EFFICIENT_ATTENTION",)
    assert (torch.cuda.get_device_capability, torch.cuda.is_bf16_supported) == before


def test_sdpa_guard_turns_no_kernel_into_a_reported_call(gw):
    """With only EFFICIENT_ATTENTION allowed, a call the kernel cannot take raises ("No viable backend" here: CPU
    has no efficient kernel; "No available kernel" on CUDA). The guard names the call, reruns it on the math kernel
    (the result is SDPA's), and the row that saw it FAILs."""
    import torch
    import torch.nn.functional as F

    from zerotune.attention import SdpaGuard

    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    orig = F.scaled_dot_product_attention
    want = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    with SdpaGuard(("EFFICIENT_ATTENTION",)) as guard:
        got = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        line = inspect.currentframe().f_lineno - 1
        row = gw.finish("a row", [], "detail", guard)
    torch.testing.assert_close(got, want)  # the math kernel's answer (the CPU default runs another kernel)
    assert F.scaled_dot_product_attention is orig
    assert row["status"] == "FAIL" and row["detail"].endswith("; detail")
    assert "math kernel for 2 call(s)" in row["detail"] and f"test_gpu_check.py:{line - 1}" in row["detail"]
    assert "q 1x4x8x16, k 1x2x8x16 float32, no mask, is_causal=True, enable_gqa=True" in row["detail"]
    assert guard.take() is None and gw.finish("next", [], "fine", guard)["status"] == "ok"
    with pytest.raises(RuntimeError, match="No viable backend"):  # outside the guard nothing is caught
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q)


def test_guard_names_transformers_call_site(gc):
    """A Llama with GQA under `sdpa` and no mask: transformers passes enable_gqa (integrations/sdpa_attention.py
    use_gqa_in_sdpa), which the memory-efficient kernel does not take; the guard names that line."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotune.attention import SdpaGuard

    cfg = gc.small_config("llama", vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa").eval()
    with SdpaGuard(("EFFICIENT_ATTENTION",)) as guard, torch.no_grad():
        model(input_ids=torch.randint(2, 256, (1, 24)), use_cache=False)
    text = guard.take()
    assert "2 x transformers/integrations/sdpa_attention.py:" in text and "enable_gqa=True" in text


def test_decode_under_sdpa_docs_packs_query_heads_without_enable_gqa(gc):
    """What the samples phase will report on a V100: sdpa_docs attends the prompt per document with K/V repeated,
    and each decode step packs the query heads of a K/V head into rows of that head (attention.py _decode_step):
    neither call has a mask or enable_gqa=True, which only the math kernel takes below sm80. Recorded here on CPU
    (the flags do not depend on the device)."""
    import torch
    import torch.nn.functional as F

    from zerotune.attention import describe_sdpa_call

    calls = []
    orig = F.scaled_dot_product_attention

    def record(*args, **kw):
        calls.append(describe_sdpa_call(args, kw)[1])
        return orig(*args, **kw)

    cfg = gc.small_config("llama", vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16)
    model = _model(cfg, "sdpa_docs").eval()
    ids = torch.randint(2, 256, (1, 24))
    F.scaled_dot_product_attention = record
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, use_cache=True, pad_token_id=0)
    finally:
        F.scaled_dot_product_attention = orig
    layers = cfg["num_hidden_layers"]
    assert len(calls) == 2 * layers, calls  # the prompt, then one decode step, in every layer
    prefill, decode = calls[0], calls[-1]
    assert "zerotune/attention.py" in prefill and "q 1x8x24x16, k 1x8x24x16" in prefill, prefill
    assert "zerotune/attention.py" in decode and "q 1x4x2x16, k 1x4x25x16" in decode, decode  # 8 heads on 4 K/V
    assert all("no mask" in c and "enable_gqa=False" in c for c in calls), calls


def _model(cfg, attn):
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotune import attention

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation=attention.load_name(attn))


# --- the 8B slice and the plan ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_slice_layers_for_a_card_memory(gc, tmp_path):
    """At ZeRO-3 world size 1 and 16K tokens: one layer of the 8B width fits a V100's 31.75 GiB (the two 128,256 x
    4,096 matrices alone are 1.05B of its 1.27B parameters), none fits a T4, more fit an H100 and an H200; each
    answer is the largest count whose planned training-step peak is within the card."""
    from zerotune.planner import compute as planmod

    def peak(gpu, n):
        cfg = gc.write_config(tmp_path / f"{gpu}-{n}.json", gc.shape_config("8b", n))
        p = planmod.compute_plan(gc.recipe(gc.zero3_recipe("t", cfg, tmp_path / "o", 16384, 3, plan_gpu=gpu)),
                                 gpu=gpu, gpus_per_node=1, nodes=1)
        return p.memory.peak_bytes, p.memory.capacity_bytes

    got = {gpu: gc.slice_layers(gpu, 16384, 3, tmp_path / gpu) for gpu in ("v100-32gb", "t4", "h100-80gb", "h200")}
    assert got["v100-32gb"][0] == 1 and got["t4"] == (0, 0)
    assert 1 < got["h100-80gb"][0] < got["h200"][0] < 32
    for gpu in ("v100-32gb", "h100-80gb", "h200"):
        n, pk = got[gpu]
        (fit, cap), (over, cap1) = peak(gpu, n), peak(gpu, n + 1)
        assert pk == fit <= cap < over and cap == cap1
    assert got["v100-32gb"][1] / GiB == pytest.approx(30.62, abs=0.01)


def test_shapes_by_hand(gc, tmp_path):
    from zerotune.planner.target import model_shape

    def n_params(cfg):
        return model_shape(gc.recipe(gc.zero3_recipe("t", gc.write_config(tmp_path / f"{id(cfg)}.json", cfg),
                                                     tmp_path / "o", 512, 1))).n_params

    # Llama-3.1-8B: untied 128,256 x 4,096 embeddings and lm_head; per layer q, o 4,096^2, k, v 4,096 x 1,024,
    # gate/up/down 4,096 x 14,336, two norms; a final norm
    layer = 2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    assert n_params(gc.shape_config("8b", 1)) == 2 * 128256 * 4096 + layer + 4096 == 1_268_789_248
    assert n_params(gc.shape_config("8b")) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    # Llama-3.2-1B: tied embeddings once; 16 layers of q, o 2,048^2, k, v 2,048 x 512, gate/up/down 2,048 x 8,192
    assert n_params(gc.shape_config("1b")) == 128256 * 2048 + 16 * (
        2 * 2048 ** 2 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048) + 2048 == 1_235_814_400


def test_plan_rows_for_the_slice(gc, tmp_path):
    """The plan a slice row is compared with: every GPU phase on the V100 (allocated <= reserved < peak with the
    overheads; resume above the card: its out-of-memory would be as predicted), and the compute term per
    micro-step on the H200 at its own peak with the V100 choice (fp16, sdpa_docs), by hand from the FLOPs."""
    from zerotune import hardware

    cfg = gc.write_config(tmp_path / "8b-1L.json", gc.shape_config("8b", 1))
    p = gc.predict(gc.zero3_recipe("slice", cfg, tmp_path / "o", 16384, 3), "v100-32gb", "h200")
    assert (p["precision"], p["attention"], p["n_params"]) == ("fp16", "sdpa_docs", 1_268_789_248)
    assert set(p["phases"]) == set(gc.PHASES) and p["capacity"] == int(31.75 * GiB)
    for phase, (alloc, reserved, peak) in p["phases"].items():
        assert 16 * p["n_params"] < alloc < reserved and alloc < peak, phase
    assert p["phases"]["train"][2] <= p["capacity"] < p["phases"]["resume"][2]
    h200, v100 = hardware.GPUS["h200"], hardware.GPUS["v100-32gb"]
    assert p["micro_s"] == pytest.approx(p["flops_micro"] / (989e12 * h200.default_mfu))
    assert p["target_micro_s"] == pytest.approx(p["flops_micro"] / (125e12 * v100.default_mfu))
    # per micro-step: 6N + recompute 2N per token, attention 4 x 2 x span x q_dim x layers per token (span 1,024)
    n, t = p["n_params"], 16384
    assert p["flops_micro"] == pytest.approx(8 * n * t + 4 * 2 * 1024 * 4096 * 1 * t)
    assert p["step_s"] > 2 * p["micro_s"]  # the step adds the optimizer and fixed terms
    short = gc.predict(gc.zero3_recipe("slice", cfg, tmp_path / "o", 512, 3), "v100-32gb", "h200")
    assert short["micro_s"] < 0.02 < short["step_s"]  # at 512 tokens the compute is a sliver of the step
    note = gc.plan_note(p, 4 * p["micro_s"])  # a quarter of the assumed efficiency
    assert "plan on h200 (989 TFLOPS x MFU 0.35)" in note and f"{p['micro_s']:.3f} s per micro-step" in note
    assert f"measured {0.35 / 4:.0%} of its peak" in note and "on v100-32gb: compute" in note


def test_packed_rows(gw):
    rows = gw.packed_rows(3, 2560, 1000, seed=0)
    assert rows == gw.packed_rows(3, 2560, 1000, seed=0) and rows[0] != rows[1]
    r = rows[0]
    assert len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"]) == 2560
    assert r["position_ids"][1022:1026] == [1022, 1023, 0, 1] and r["position_ids"][-1] == 2560 - 2048 - 1
    masked = [i for i, x in enumerate(r["labels"]) if x == -100]
    assert masked == [s + j for s in (0, 1024, 2048) for j in range(8)]
    assert r["labels"][8] == r["input_ids"][8]


def test_packed_logits_equal_per_document_on_cpu(gc, gw):
    """The comparison the SDPA check runs on the GPU, in fp32 on CPU, under both attentions a V100 may train
    with; the control (no position_ids) shows the comparison would see a leak."""
    import torch

    cfg = gc.small_config("llama", vocab_size=1024, hidden_size=256, intermediate_size=512, head_dim=32,
                          initializer_range=0.1)
    torch.manual_seed(0)
    model = _model(cfg, "sdpa_docs").train()
    for attn in ("sdpa_docs", "sdpa"):
        model.set_attn_implementation(attn)
        res = gw.packed_vs_documents(model, (40, 56), 1024)
        assert res["max_diff"] <= res["tol"] and res["control_diff"] > 10 * res["tol"], (attn, res["max_diff"])
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert gw.sdpa_backends_used(lambda: model(input_ids=res["ids"], position_ids=res["pos"])) == ["math"]


def test_shard_attention_on_cpu(gw):
    """The sequence-parallel row's attention the kit times on a card (check_sp_attention), at a small shape on CPU:
    grouped heads over the whole row, one fused kernel, finite gradients; the shard's heads must group evenly."""
    import torch

    got = gw.shard_attention(heads=4, kv_heads=2, head_dim=16, docs=(40, 24), dtype=torch.float32, device="cpu")
    assert got["finite"] and got["seq"] == 64 and got["used"] and "math" not in got["used"], got


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_family_liger_config_reaches_the_block_rmsnorm_kernel(gc, family):
    """The Liger check's shape sends the q norm through Liger's block RMSNorm kernel (n_cols <= 256 and n_rows >=
    4096 * 8 in liger_kernel/ops/rms_norm.py), as Qwen3-8B's and Gemma 3's q/k norms at 8K do."""
    from liger_kernel.ops import rms_norm
    from transformers import AutoConfig

    from zerotune.families import FAMILIES, of_config

    cfg = gc.small_config(family)
    assert of_config(AutoConfig.for_model(**cfg)).name == family and cfg["head_dim"] == 128
    assert cfg["num_attention_heads"] * 4096 >= 4096 * 8  # the check's seq is 4096
    assert "n_rows < 4096 * 8" in inspect.getsource(rms_norm)
    assert FAMILIES[family].liger_kernels["rms_norm"]


# --- the report and the parent --------------------------------------------------------------------------------------

def _info():
    from zerotune.emulation import emulation_for

    return {"name": "NVIDIA H200", "capability": [9, 0], "total_memory": H200[1], "device_count": 1, "cuda": "13.0",
            "arch_list": ["sm_90"], "versions": {"torch": "2.11.0", "deepspeed": "0.19.8"}, "card": "h200",
            "emulation": asdict(emulation_for("v100-32gb", *H200))}


def test_table_markdown_and_header(gc):
    rows = [gc.make_row("8B slice 1L 16,384: train", "ok", "fp16 | 3 steps", allocated=int(20.5 * GiB),
                        reserved=24 * GiB, seconds=0.61, predicted_allocated=20 * GiB,
                        predicted_reserved=int(25.8 * GiB), predicted_seconds=0.482),
            gc.make_row("sdpa packed: flash_attention_2", "skipped", "V100-SXM2-32GB: no FlashAttention 2"),
            gc.make_row("liger llama", "FAIL", "RuntimeError: boom", allocated=GiB // 4, seconds=0.01)]
    lines = gc.format_table(rows).splitlines()
    assert lines[0].split()[:2] == ["check", "status"] and "plan s" in lines[0] and lines[0].endswith("detail")
    train, fa2, liger = lines[2:]
    for cell in ("20.50", "24.00", "20.00", "25.80", "1.02", "0.61", "0.482"):
        assert cell in train
    assert " skipped " in fa2 and fa2.count(" - ") >= 7 and " FAIL " in liger
    col = lines[0].index("status")
    assert all(line[col:].split()[0] in ("ok", "FAIL", "skipped") for line in lines[2:])
    head = gc.header_lines(_info())
    assert "NVIDIA H200 (sm90" in head[0] and "139.80 GiB" in head[0] and "torch 2.11.0" in head[1]
    assert head[2].startswith("gpu_check: rows run as v100-32gb (--as): ") and "30.85 GiB" in head[2]
    assert head[3].startswith("gpu_check: not emulated: ") and "sm90" in head[3]
    md = gc.format_markdown(_info(), rows).splitlines()
    assert md[0] == "# gpu_check" and md[4].startswith("- rows run as v100-32gb") and "not emulated" in md[5]
    assert md[7].startswith("| check | status |") and md[8].count("---|") == len(gc.COLUMNS)
    assert "fp16 \\| 3 steps" in md[9] and len(md) == 9 + len(rows)
    with pytest.raises(AssertionError):
        gc.make_row("x", "passed")


def test_crash_reason(gc):
    err = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB\n"
    assert gc.crash_reason(1, err).endswith("torch.OutOfMemoryError: CUDA out of memory. Tried 2 GiB")
    assert "signal 9: killed, host out of memory?" in gc.crash_reason(-9, "")


@pytest.mark.slow
def test_worker_process_protocol(gc, tmp_path, monkeypatch):
    """A real worker process: its failure (no CUDA) comes back as a FAIL row with one line, its log is kept."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    payload = gc.run_worker("env", {"as": "v100-32gb"}, gc.parse_args(["--timeout", "300"]), tmp_path, "env")
    (row,) = payload["rows"]
    assert row["check"] == "env" and row["status"] == "FAIL" and "\n" not in row["detail"]
    assert "CUDA" in row["detail"] or "cuda" in row["detail"]
    log = (tmp_path / "env.log").read_text()
    assert "gpu_check_worker.py env" in log and gc.ROW_MARK in log and (tmp_path / "env.spec.json").exists()


@pytest.mark.slow
def test_parent_with_fake_workers(gc, tmp_path, monkeypatch, capsys):
    """The parent's GPU branch with the worker processes replaced: the header, the rows with their plan, the 8B
    slice's layers, the resume handed what was saved, the A/B row from both runs, JSON + markdown, exit 1 on a FAIL."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def fake(name, spec, a, log_dir, label):
        calls.append((label, spec))
        if name == "env":
            return {"rows": [], "info": _info()}
        if name == "fp16_loss_scale":
            return {"rows": [gc.make_row("fp16 loss scale", "FAIL", "boom")]}
        tag, attn = spec["tag"], spec["recipe"]["train"]["attention"]
        if spec.get("resume"):
            return {"rows": [gc.make_row(f"{tag}: resume", "ok", "equal", allocated=GiB)]}
        micro = {"sdpa": 2.0}.get(attn, 1.0)
        return {"rows": [gc.make_row(f"{tag}: {p}", "ok", p, allocated=20 * GiB, seconds=micro) for p in spec["phases"]],
                "info": {"saved": "save" in spec["phases"], "fingerprint": {"step": 3}, "val_loss": 12.0,
                         "losses": [12.0, 12.1, 12.2], "micro_s": micro, "step_s": 2 * micro}}

    monkeypatch.setattr(gc, "run_worker", fake)
    out = tmp_path / "res"
    rc = gc.main(["--checks", "fp16_loss_scale,attention_ab,zero3_8b", "--out", str(out), "--tmpdir", str(tmp_path)])
    assert rc == 1
    text = capsys.readouterr().out
    assert "rows run as v100-32gb" in text and "1 failed" in text
    res = json.loads((out / "gpu_check.json").read_text())
    rows = {r["check"]: r for r in res["rows"]}
    assert res["failed"] == 1 and res["args"]["target"] == "v100-32gb" and (out / "gpu_check.md").exists()
    labels = [label for label, _ in calls]
    assert labels == ["env", "fp16_loss_scale", "ab_sdpa_docs", "ab_sdpa", "slice8b_16384", "slice8b_16384_resume",
                      "slice8b_512"]
    spec = dict(calls)
    assert spec["fp16_loss_scale"]["hysteresis"] == 2 and spec["fp16_loss_scale"]["recipe"]["train"]["max_steps"] == 4
    assert all(s["as"] == "v100-32gb" for s in spec.values())
    slice16 = spec["slice8b_16384"]
    assert slice16["n_params"] == 1_268_789_248 and slice16["phases"] == ["train", "validation", "samples", "save"]
    assert slice16["expect"]["peaks"]["resume"] > slice16["expect"]["capacity"] == int(31.75 * GiB)
    assert spec["slice8b_16384_resume"]["resume"] == {"fingerprint": {"step": 3}, "val_loss": 12.0}
    assert spec["slice8b_512"]["phases"] == ["train"]
    assert Path(slice16["recipe"]["model"]["init_config"]).name == "8b-1L.json"  # as the planner was fed
    train = rows["8B slice 1L 16,384: train"]
    assert train["predicted_allocated_bytes"] > 16 * 1_268_789_248 and train["predicted_seconds"] > 0
    assert "1 of 32 layers" in train["detail"] and "plan on h200" in train["detail"]
    assert rows["8B slice 1L 16,384: resume"]["status"] == "ok" and "8B slice 1L 512: train" in rows
    ab = rows["attention 1B 16,384: sdpa_docs vs sdpa"]
    assert ab["status"] == "ok" and "sdpa_docs 2.00x faster" in ab["detail"] and "losses equal" in ab["detail"]
    assert spec["ab_sdpa_docs"]["recipe"]["output_dir"] == spec["ab_sdpa"]["recipe"]["output_dir"]  # one base
    assert not any(p.name.startswith("gpu_check_") for p in tmp_path.iterdir())  # the temp root is removed


@pytest.mark.integration
@pytest.mark.extended  # ~2 min; CI: the kit's worker protocol and parent (this file), the phases' worker code (training tests)
def test_zero3_rows_on_cpu(gc, tmp_path):
    """A ZeRO-3 row set through real worker processes on CPU (DeepSpeed on gloo, a tiny Llama, fp32, no Liger):
    every phase through the worker's functions, then resume in a fresh process with equal fingerprints."""
    from zerotune.emulation import emulation_for

    a = gc.parse_args(["--as", "native", "--steps", "2"])
    kit = gc.Kit(a, {"emulation": asdict(emulation_for("native", None, 0)), "card": "cpu"}, tmp_path, tmp_path)
    cfg = gc.write_config(tmp_path / "tiny.json", gc.small_config(
        "llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16))
    rows, info = kit.zero3("tiny 256", "tiny", cfg, 256, gc.PHASES)
    assert [(r["check"], r["status"]) for r in rows] == [(f"tiny 256: {p}", "ok") for p in gc.PHASES], rows
    assert "7/7 fingerprints equal" in rows[-1]["detail"] and len(info["losses"]) == 2
    assert rows[0]["predicted_allocated_bytes"] and "plan gpu cpu" in rows[0]["detail"]
