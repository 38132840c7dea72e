"""Finalize and resume checks (issue 19 items 1, 2, 8): a bounded probe, finalize's host RAM at 8B, and
what a resume at another world size refuses (issue 34). Unit tests: seconds, no training."""

from __future__ import annotations

import pytest

from zerotune.config import load_recipe
from zerotune.errors import UserError
from zerotune.hardware import dtype_bytes
from zerotune.verify import PROBE_TOKENS, model_dtype, probe_bytes, probe_inputs

LLAMA8B_PARAMS = 8_030_261_248
LLAMA8B_VOCAB = 128_256


def _probe_tokens(seq_len: int) -> int:
    """The probe the worker takes from one packed row of this recipe's data.seq_len."""
    from zerotune.train.args import collate_packed

    r = load_recipe("llama8b_zero3", [f"data.seq_len={seq_len}"])
    n = r.data.seq_len
    row = {"input_ids": list(range(n)), "labels": list(range(n)), "position_ids": list(range(n))}
    probe = probe_inputs(collate_packed([row]))
    assert set(probe) == {"input_ids", "position_ids"}  # labels are not needed to get logits
    shapes = {tuple(v.shape) for v in probe.values()}
    assert len(shapes) == 1
    return shapes.pop()[1]


def test_probe_size_does_not_grow_with_seq_len():
    assert _probe_tokens(16384) == _probe_tokens(2048) == PROBE_TOKENS
    assert _probe_tokens(128) == 128  # a row shorter than the probe is taken whole


def test_stored_probe_is_bounded_at_8b():
    import torch

    # fp16 training stores 256 x 128,256 x 2 B; a whole 16K row in fp32 was 8.4 GB
    assert probe_bytes(LLAMA8B_VOCAB, "fp16") == 256 * 128_256 * 2 == 65_667_072
    assert probe_bytes(LLAMA8B_VOCAB, "fp16") * 100 < 16_384 * LLAMA8B_VOCAB * 4
    # and it is what torch allocates for logits of that shape in the training dtype (meta: no memory)
    logits = torch.empty(1, PROBE_TOKENS, LLAMA8B_VOCAB, dtype=model_dtype("fp16"), device="meta")
    assert logits.numel() * logits.element_size() == probe_bytes(LLAMA8B_VOCAB, "fp16")
    assert model_dtype("fp32") == torch.float32 and model_dtype("bf16") == torch.bfloat16
    assert dtype_bytes("fp32") == 4 and dtype_bytes("fp16") == 2


def test_finalize_host_ram_of_the_qlora_merge_at_8b():
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.finalize_ram import INTERPRETER_BYTES
    from zerotune.planner.records import FinalizeHostRam
    from zerotune.planner.report import format_plan, warning

    r = load_recipe("llama8b_qlora_t4")
    p = compute_plan(r)
    assert p.model.n_params == LLAMA8B_PARAMS
    parts = p.phases.finalize.parts
    # fp16 base (T4 trains in fp16), r=16 adapters on the 7 linears of 32 layers in fp32,
    # B @ A of the largest linear (14336 x 4096) in fp32 plus its fp16 cast, 3 fp32 probe logits
    lora = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert lora == 41_943_040
    expected = (LLAMA8B_PARAMS * 2 + lora * 4 + 14336 * 4096 * (4 + 2) + 3 * 256 * LLAMA8B_VOCAB * 4
                + INTERPRETER_BYTES)
    assert sum(parts.values()) == p.phases.finalize.peak_bytes == expected
    assert 17.5e9 < expected < 18.5e9 <= 32e9  # the recipe comment says 18.0 GB, within plan.cpu_ram_gb 32
    assert "finalize (after training, CPU): peak host RAM 18.0 GB of 32 GB (plan.cpu_ram_gb): fits" in format_plan(p)
    assert not any("finalize" in warning(w) for w in p.warnings)
    small = compute_plan(load_recipe("llama8b_qlora_t4", ["plan.cpu_ram_gb=16"]))
    assert any(isinstance(w, FinalizeHostRam) and "finalize" in warning(w) and "18.0 GB" in warning(w)
               for w in small.warnings)
    assert "DOES NOT FIT" in format_plan(small)


def test_finalize_host_ram_of_full_fine_tuning_has_no_merge_terms():
    from zerotune.planner.compute import compute_plan

    parts = compute_plan(load_recipe("llama8b_zero3")).phases.finalize.parts
    assert not any("adapter" in k or "merge" in k for k in parts)
    assert next(v for k, v in parts.items() if k.startswith("model")) == 2 * LLAMA8B_PARAMS


def _fake_zero_checkpoint(root, ranks: int, step: int = 4):
    ckpt = root / f"checkpoint-{step}"
    (ckpt / f"global_step{step}").mkdir(parents=True)
    for i in range(ranks):  # the names DeepSpeed writes (engine.py _get_rank_zero_ckpt_name)
        (ckpt / f"global_step{step}" / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt").write_bytes(b"")
        (ckpt / f"global_step{step}" / f"zero_pp_rank_{i}_mp_rank_00_model_states.pt").write_bytes(b"")
    return ckpt


def test_world_size_change_is_detected_and_refused_only_where_the_batch_or_order_cannot_stay(tmp_path):
    """reshard.saved_world_if_other/refuse_unresumable, before anything is converted: one message each, naming
    the fix."""
    import json

    from zerotune import reshard
    from zerotune.checkpoint import MARKER, saved_world_size

    ckpt = _fake_zero_checkpoint(tmp_path / "checkpoints", 4)
    assert saved_world_size(ckpt) == 4
    assert reshard.saved_world_if_other(ckpt, 4) is None and reshard.saved_world_if_other(None, 1) is None
    assert reshard.saved_world_if_other(ckpt, 2) == 4
    plain = tmp_path / "plain" / "checkpoint-2"  # no DeepSpeed (QLoRA): its optimizer.pt is whole, no conversion
    plain.mkdir(parents=True)
    (plain / "adapter_model.safetensors").write_bytes(b"")
    assert saved_world_size(plain) is None and reshard.saved_world_if_other(plain, 3) is None

    # tiny: 1,024 tokens = 4 rows of 256 per step: 1, 2 or 4 processes keep it
    r = load_recipe("tiny", [f"output_dir={tmp_path}"])
    for world in (1, 2):
        reshard.refuse_unresumable(r, ckpt, 4, world)
    with pytest.raises(UserError) as e:
        reshard.refuse_unresumable(r, ckpt, 4, 3)
    msg = str(e.value)
    assert "3 processes cannot split it evenly" in msg and "divides 4: 2 or 4" in msg and "\n" not in msg
    with pytest.raises(UserError) as e:
        reshard.refuse_unresumable(load_recipe("tiny", [f"output_dir={tmp_path}", "data.packing=false"]), ckpt, 4, 2)
    assert "data.packing=false" in str(e.value) and "Resume with 4 processes" in str(e.value)
    (ckpt / MARKER).write_text(json.dumps({"step": 4, "world_size": 4, "global_batch_tokens": 2048}))
    with pytest.raises(UserError) as e:
        reshard.refuse_unresumable(r, ckpt, 4, 2)
    assert "trained with train.global_batch_tokens=2,048 and this run asks for 1,024" in str(e.value)
    # at the checkpoint's own world size too (convert_for() calls it for every resume, converted or not)
    with pytest.raises(UserError, match="trained with train.global_batch_tokens=2,048"):
        reshard.refuse_other_batch(r, ckpt)


def test_finalize_gets_the_jobs_cpus(monkeypatch):
    import os

    from zerotune.train.finalize import job_cpus

    mine = len(os.sched_getaffinity(0))
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    assert job_cpus() == mine
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "1")
    assert job_cpus() == 1
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "4096")  # the affinity mask is the tighter bound here
    assert job_cpus() == mine


@pytest.mark.slow
def test_lora_finalize_in_fp16_on_cpu(tmp_path, tiny_model_dir):
    """The GPU-run path of finalize (16-bit merge, save, reload) exercised on the CPU in fp16."""
    import torch
    from peft import get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from zerotune.adapters import finalize_peft, lora_config
    from zerotune.train.handoff import Probe

    r = load_recipe("tiny_lora", [f"output_dir={tmp_path / 'run'}", "peft.modules_to_save=[]"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float16),
                           lora_config(r))
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # a fresh adapter is zero in B: make it change the model like a trained one
            p.data.normal_(0, 0.05)
    tmp = r.out / "model.tmp"
    model.save_pretrained(str(tmp))
    probe = probe_inputs({"input_ids": torch.randint(0, 5000, (1, PROBE_TOKENS + 44))})
    model.eval()
    with torch.no_grad():
        ref_logits = model(**probe, use_cache=False).logits.to(model_dtype("fp16"))
    ref = Probe(probe, ref_logits, n_params=0, precision="fp16", trainable_params=1)
    report = finalize_peft(r, tmp, r.out / "model", ref, tiny_model_dir, lambda p: None)

    assert report["probe_tokens"] == PROBE_TOKENS and report["top1_agreement"] == 1.0
    assert 0 < report["merge_max_abs_logit_diff"] < 5e-2 * max(1.0, ref_logits.float().abs().max().item())
    with safe_open(str(r.out / "model" / "model.safetensors"), "pt") as st:
        assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"F16"}, "the merged model is saved in 16-bit"
    assert (r.out / "adapter" / "adapter_model.safetensors").exists() and not tmp.exists()


def test_fp16_loss_scale_follows_grad_accum_across_a_world_size_change():
    """DeepSpeed's own dynamic scaler, as the universal load restores it: rescaled for the new grad-accum."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from zerotune.train.reshard_load import rescale_loss_scale

    kw = dict(scale_window=1000, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False)  # DeepSpeed defaults
    s = DynamicLossScaler(init_scale=2.0 ** 12, **kw)
    assert rescale_loss_scale(s, 240, 240) is None and s.cur_scale == 2.0 ** 12
    assert rescale_loss_scale(s, 240, 120) == (2.0 ** 12, 2.0 ** 11)  # 2 -> 4 nodes: gradients twice as large
    assert rescale_loss_scale(s, 120, 480) == (2.0 ** 11, 2.0 ** 13)  # 4 nodes -> 1: a quarter
    assert rescale_loss_scale(s, 3, 2) == (2.0 ** 13, 2.0 ** 12)      # 2/3: the nearest power of two
    low = DynamicLossScaler(init_scale=2.0, **kw)
    assert rescale_loss_scale(low, 8, 1) == (2.0, 1.0)                # never below min_scale
    assert rescale_loss_scale(object(), 8, 1) is None                 # fp32 / bf16: no dynamic scaler
