"""The capability table decides precision, attention and Liger; impossible requests are errors."""

import pytest

from zerotune.hardware import GPUS, CapabilityError, choose, gpu_for_capability


@pytest.mark.parametrize("cap,name,precision,attention,liger", [
    ((7, 0), "Tesla V100-SXM2-32GB", "fp16", "sdpa_docs", True),
    ((7, 5), "Tesla T4", "fp16", "sdpa_docs", True),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "bf16", "flash_attention_2", True),
    ((9, 0), "NVIDIA H100 80GB HBM3", "bf16", "flash_attention_2", True),
    (None, "", "fp32", "sdpa_docs", False),
])
def test_auto_choices_by_capability(cap, name, precision, attention, liger):
    c = choose(gpu_for_capability(cap, name), fa2_installed=True)
    assert (c.precision, c.attention, c.liger) == (precision, attention, liger)
    assert any("auto ->" in why for why in c.reasons), "auto must say what it chose"


def test_sm80_without_flash_attn_installed_uses_sdpa_docs_and_says_why():
    c = choose(GPUS["a100-80gb"], fa2_installed=False)
    assert c.attention == "sdpa_docs"
    assert any("flash-attn not installed" in why for why in c.reasons)


def test_unlisted_gpu_follows_its_architecture():
    g = gpu_for_capability((8, 6), "NVIDIA RTX A6000")
    assert g.bf16 and g.flash_attention_2 and g.peak_tflops is None


@pytest.mark.parametrize("gpu,kw,fix", [
    ("v100-32gb", {"attention": "flash_attention_2"}, "train.attention=sdpa_docs"),
    ("t4", {"precision": "bf16"}, "train.precision=fp16"),
    ("cpu", {"precision": "fp16"}, "train.precision=fp32"),
    ("cpu", {"liger": "on"}, "train.liger=off"),
])
def test_impossible_requests_name_the_alternative(gpu, kw, fix):
    with pytest.raises(CapabilityError, match=fix.replace(".", r"\.")):
        choose(GPUS[gpu], fa2_installed=True, **kw)


def test_flash_attention_requested_but_not_installed():
    with pytest.raises(CapabilityError, match=r"pip install -e \.\[flash\]"):
        choose(GPUS["h100-80gb"], attention="flash_attention_2", fa2_installed=False)


def test_explicit_valid_requests_are_kept():
    c = choose(GPUS["v100-32gb"], precision="fp16", attention="eager", liger="off")
    assert (c.precision, c.attention, c.liger) == ("fp16", "eager", False)


def test_capacity_is_the_total_pytorch_reports():
    # "31.75 GiB total capacity" in a V100-SXM2-32GB's OOM messages, not 32: the one memory figure per GPU
    assert GPUS["v100-32gb"].usable_gib == 31.75
    assert 14.5 < GPUS["t4"].usable_gib < 15 and GPUS["a100-80gb"].usable_gib < 80 > GPUS["h100-80gb"].usable_gib
    assert not hasattr(GPUS["v100-32gb"], "memory_gib")


# torch.cuda.get_arch_list() of real torch wheels:
#   2.11.0+cu126 and 2.11.0+cu128, 2.10.0+cu128: printed in pytorch #182250 (a maintainer's comment, 2026-05-03)
#   2.11.0+cu130: printed by `make gpu-check` on the lent H200 (bench/results/gpu_check/h200_2026-11-26.log)
#   2.7.1+cu128, with PTX for 12.0: printed on an RTX PRO 6000 Blackwell (a public setup note; the build's
#     TORCH_CUDA_ARCH_LIST "...;12.0+PTX", pytorch RELEASE.md support matrix)
ARCHS = {
    "2.11.0+cu126": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
    "2.11.0+cu128": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
    "2.10.0+cu128": ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
    "2.11.0+cu130": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
    "2.7.1+cu128": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"],
}
V100, T4, A100, H100 = (7, 0), (7, 5), (8, 0), (9, 0)


@pytest.mark.parametrize("build,runs", [
    ("2.11.0+cu126", {V100, T4, A100, H100}),
    ("2.11.0+cu128", {T4, A100, H100}),
    ("2.10.0+cu128", {V100, T4, A100, H100}),
    ("2.11.0+cu130", {T4, A100, H100}),
    ("2.7.1+cu128", {T4, A100, H100}),
])
def test_which_cards_a_torch_wheel_runs_on(build, runs):
    from zerotune.hardware import CU126_ARCHS, runs_on

    for cap in (V100, T4, A100, H100):
        assert runs_on(cap, ARCHS[build]) == (cap in runs), (build, cap)
    assert list(CU126_ARCHS) == ARCHS["2.11.0+cu126"]


def test_the_arch_rule_sass_within_a_major_ptx_forward_arch_specific_exact():
    from zerotune.hardware import runs_on

    assert runs_on((8, 6), ["sm_80"]) and runs_on((8, 9), ["sm_86"])  # later minor, same major: SASS runs
    assert not runs_on((8, 0), ["sm_86"]) and not runs_on((9, 0), ["sm_80"])  # earlier minor, or another major
    assert runs_on((12, 1), ARCHS["2.7.1+cu128"]) and runs_on((10, 3), ["compute_90"])  # PTX: JIT for later cards
    assert not runs_on((7, 5), ["compute_80"])  # PTX never runs backwards
    assert runs_on((9, 0), ["sm_90a"]) and not runs_on((9, 1), ["sm_90a"])  # arch-specific: its own card only
    assert not runs_on((7, 0), []) and not runs_on((7, 0), ["sm_xx", "gfx90a"])


def _cuda(monkeypatch, cap, name, archs, version="2.11.0+cu130", cuda="13.0"):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)


def test_the_launch_refuses_a_wheel_without_the_cards_kernels(monkeypatch, tmp_path):
    """before_launch (zerotune finetune, slurm/job.py preflight) checks first: one message, exit 2, naming the fix."""
    from zerotune.config import load_recipe
    from zerotune.errors import EXIT_CODE, UserError, report
    from zerotune.hardware import require_kernels
    from zerotune.train.launch import before_launch
    from zerotune.reshard import convert_for  # noqa: F401  # before_launch's imports, loaded before torch is faked:
    # they load peft and bitsandbytes, which read torch.version.cuda at import

    _cuda(monkeypatch, V100, "Tesla V100-SXM2-32GB", ARCHS["2.11.0+cu130"])
    with pytest.raises(UserError) as e:  # before anything else is looked at: the recipe's weights are not there
        before_launch(load_recipe("tiny", [f"output_dir={tmp_path}"]), 2)
    msg = str(e.value)
    assert msg.startswith("GPU 0 (Tesla V100-SXM2-32GB, compute capability 7.0) has no kernels in this torch "
                          "2.11.0+cu130 (CUDA 13.0; built for sm_75, sm_80, sm_86, sm_90, sm_100, sm_120)")
    assert "`make setup TORCH=cu126`" in msg and "#157517" in msg and "\n" not in msg
    assert report(e.value) == EXIT_CODE
    assert not (tmp_path / "train").exists()

    _cuda(monkeypatch, (6, 1), "Tesla P40", ARCHS["2.11.0+cu128"], "2.11.0+cu128", "12.8")  # cu126 has sm_60
    with pytest.raises(UserError, match="TORCH=cu126"):
        require_kernels()
    _cuda(monkeypatch, (3, 7), "Tesla K80", ARCHS["2.11.0+cu126"], "2.11.0+cu126", "12.6")  # no wheel has it
    with pytest.raises(UserError, match=r"covers sm_37 \(`make setup TORCH=<its CUDA tag>`"):
        require_kernels()
    for build, cap in (("2.11.0+cu126", V100), ("2.11.0+cu130", T4), ("2.11.0+cu130", H100)):
        _cuda(monkeypatch, cap, "a card it runs", ARCHS[build], build)
        require_kernels()
