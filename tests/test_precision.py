"""Precision on the V100/T4 path (issue 19 items 3, 4, 7): fp16 loss scale from the batch plan, the zero-gradient
metric, Liger's fused CE below sm80, and QLoRA's fp32 upcasts in the planner. Arithmetic at 8B size; no GPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from zerotune.batch import derive
from zerotune.config import load_recipe
from zerotune.ds_config import build, loss_scale
from zerotune.metrics import StepMetrics


# ------------------------------------------------------------------------------ item 3: fp16 loss scale

@pytest.mark.parametrize("ga, steps, power, window", [
    (1, 5000, 16, 500),     # DeepSpeed's default power; a long run keeps a long window
    (16, 200, 20, 20),      # 2^16 x 16: micro-batch gradients are 1/16 of a GA-1 run's
    (480, 30, 24, 10),      # capped at 8 extra powers (2^25 would be exact); 30 steps: window 10, not 1000
])
def test_loss_scale_follows_grad_accum_and_run_length(ga, steps, power, window):
    assert loss_scale(ga, steps) == (power, window)


def test_deepspeed_config_takes_the_scale_from_the_batch_plan():
    r = load_recipe("llama8b_zero3")
    bp = derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 8)
    fp16 = build(r, bp, 30)["fp16"]
    assert fp16["initial_scale_power"] == 16 + min(8, (bp.grad_accum - 1).bit_length())
    assert fp16["loss_scale_window"] == 10
    assert fp16["enabled"] == "auto"  # the Trainer's key stays the Trainer's
    plain = build(r)["fp16"]  # no batch plan (planning before data): DeepSpeed's defaults, never "auto"
    assert (plain["initial_scale_power"], plain["loss_scale_window"]) == (16, 1000)


def test_a_number_in_a_user_json_is_kept(tmp_path):
    cfg = json.loads(open("configs/deepspeed/zero3.json").read())
    cfg["fp16"]["initial_scale_power"] = 12
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    r = load_recipe("llama8b_zero3", [f"train.deepspeed={tmp_path / 'ds.json'}"])
    fp16 = build(r, derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 8), 30)["fp16"]
    assert fp16["initial_scale_power"] == 12 and fp16["loss_scale_window"] == 10


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=128)).to(dtype).train()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_gradient_fraction_sees_fp16_underflow(tmp_path, dtype):
    """A loss scaled down as at an extreme GA flushes fp16 gradients to 0; the same step in fp32 keeps them."""
    model = _tiny_llama(dtype)
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=64, label_fraction=1.0, flops_tok=1.0,
                     peak_tflops=None, world_size=1)
    cb.watch_grads(model)
    args = SimpleNamespace(fp16=False, device=torch.device("cpu"))
    x = torch.randint(0, 128, (2, 32))
    fractions = []
    for step, factor in ((1, 1.0), (2, 2.0 ** -30)):
        model.zero_grad()
        (model(input_ids=x, labels=x).loss * factor).backward()
        cb.on_step_end(args, SimpleNamespace(global_step=step), None)
        fractions.append(cb.rows[-1]["grad_zero_frac"])
    assert fractions[0] < 0.01  # ordinary gradients: almost no exact zeros
    if dtype == torch.float16:
        assert fractions[1] > 0.9  # below fp16's smallest subnormal (2^-24): gone
    else:
        assert fractions[1] < 0.01  # fp32 reaches 1e-45: the same gradients survive


def test_zero_gradient_fraction_is_logged_once_per_step(tmp_path, capsys):
    model = _tiny_llama(torch.float32)
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=64, label_fraction=1.0, flops_tok=1.0,
                     peak_tflops=None, world_size=1)
    cb.watch_grads(model)
    x = torch.randint(0, 128, (2, 32))
    model(input_ids=x, labels=x).loss.backward()
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    cb.on_step_end(SimpleNamespace(fp16=False, device=torch.device("cpu")), state, None)
    cb.on_log(None, state, None, logs={"loss": 4.0})
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert "grad_zero_frac" in row
    assert capsys.readouterr().out.count("zero grads") == 1
