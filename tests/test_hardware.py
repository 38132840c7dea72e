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
