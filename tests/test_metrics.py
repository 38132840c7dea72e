"""The per-step safety checks in metrics.StepMetrics: fp16 overflow at the minimum scale, non-finite loss.

DeepSpeed's fp16 engine needs CUDA, so the engine here is a plain object exposing the attributes the
callback reads from DeepSpeed's engine (skipped_steps, optimizer.loss_scale / overflow, config).
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from zerotune.metrics import FP16OverflowError, NonFiniteLossError, StepMetrics, flops_per_token


def _callback(tmp_path, overflow: bool, scale: float):
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=1024, label_fraction=0.25, flops_tok=1e6,
                     peak_tflops=125.0, world_size=2, max_overflows_at_min_scale=3)
    engine = SimpleNamespace(skipped_steps=0, config={"fp16": {"min_loss_scale": 1}},
                             optimizer=SimpleNamespace(loss_scale=scale, overflow=overflow))
    cb.trainer = SimpleNamespace(model_wrapped=engine)
    args = SimpleNamespace(fp16=True, device=torch.device("cpu"))
    return cb, args, engine


def test_repeated_overflow_at_min_scale_stops_with_a_clear_message(tmp_path):
    cb, args, engine = _callback(tmp_path, overflow=True, scale=1.0)
    for step in (1, 2):
        engine.skipped_steps = step
        cb.on_step_end(args, SimpleNamespace(global_step=step), None)
    assert cb.rows[-1]["loss_scale"] == 1.0 and cb.rows[-1]["skipped_steps"] == 2
    with pytest.raises(FP16OverflowError, match="overflowed 3 steps in a row at the minimum loss scale"):
        cb.on_step_end(args, SimpleNamespace(global_step=3), None)


def test_overflow_above_min_scale_is_only_logged(tmp_path):
    cb, args, _ = _callback(tmp_path, overflow=True, scale=1024.0)
    for step in range(1, 10):
        cb.on_step_end(args, SimpleNamespace(global_step=step), None)
    assert cb.rows[-1]["loss_scale"] == 1024.0


def test_non_finite_loss_stops_training(tmp_path):
    cb, args, _ = _callback(tmp_path, overflow=False, scale=65536.0)
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    cb.on_step_begin(args, state, None)
    sum(range(100_000))  # a measurable step time
    cb.on_step_end(args, state, None)
    cb.on_log(args, state, None, logs={"loss": 2.5, "grad_norm": 1.0, "learning_rate": 1e-5})
    row = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert row["loss"] == 2.5 and row["mfu"] > 0 and row["tokens_per_s"] > 0
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 2"):
        cb.on_log(args, SimpleNamespace(global_step=2, is_world_process_zero=True), None, logs={"loss": math.nan})


def test_flops_per_token_for_llama8b():
    # 6N dominates; causal attention adds 6*L*d*S per token (at 16K: ~0.2x of 6N)
    f = flops_per_token(8_030_261_248, 32, 4096, 16384)
    assert f == pytest.approx(6 * 8_030_261_248 + 6 * 32 * 4096 * 16384)


def test_label_tokens_are_counted_per_step_not_estimated(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)).train()
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=32, label_fraction=0.5, flops_tok=1.0,
                     peak_tflops=None, world_size=1)
    cb.count_labels(model)
    args, state = SimpleNamespace(fp16=False, device=torch.device("cpu")), SimpleNamespace(global_step=1)
    x = torch.randint(0, 64, (2, 16))
    for n_masked in (3, 10):  # two micro-batches of one optimizer step
        labels = x.clone()
        labels[:, :n_masked] = -100
        model(input_ids=x, labels=labels)
    model.eval()
    model(input_ids=x, labels=x)  # evaluation forwards are not training tokens
    cb.on_step_end(args, state, None)
    assert cb.rows[-1]["label_tokens"] == 2 * (16 - 3) + 2 * (16 - 10)  # not 32 x 0.5
    state.global_step = 2
    cb.on_step_end(args, state, None)
    assert cb.rows[-1]["label_tokens"] == 0  # reset every step
