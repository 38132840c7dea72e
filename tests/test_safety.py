"""The policies that stop a run because training went wrong (safety.py): fp16 overflow at the minimum scale,
a non-finite loss; each judged before StepMetrics logs the step. The lm_head and DeepSpeed-scaler policies are
tested with the rest of the fp16 path in tests/test_precision.py.

DeepSpeed's fp16 engine needs CUDA, so the engine here is a plain object exposing the attributes read from
DeepSpeed's engine (skipped_steps, optimizer.loss_scale / overflow, config).
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from zerotune.metrics import StepMetrics
from zerotune.safety import FP16OverflowError, NonFiniteLossError, SafetyChecks


def _callbacks(tmp_path, overflow: bool, scale: float):
    """SafetyChecks and StepMetrics in the worker's order, on a fake fp16 engine."""
    safety = SafetyChecks(max_overflows_at_min_scale=3)
    metrics = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=1024, label_fraction=0.25, flops_tok=1e6,
                          peak_tflops=125.0, world_size=2, safety=safety)
    engine = SimpleNamespace(skipped_steps=0, config={"fp16": {"min_loss_scale": 1}},
                             optimizer=SimpleNamespace(loss_scale=scale, overflow=overflow))
    safety.trainer = metrics.trainer = SimpleNamespace(model_wrapped=engine)
    args = SimpleNamespace(fp16=True, device=torch.device("cpu"))
    return [safety, metrics], metrics, args, engine


def test_repeated_overflow_at_min_scale_stops_with_a_clear_message(tmp_path):
    callbacks, metrics, args, engine = _callbacks(tmp_path, overflow=True, scale=1.0)
    for step in (1, 2):
        engine.skipped_steps = step
        for cb in callbacks:
            cb.on_step_end(args, SimpleNamespace(global_step=step), None)
    assert metrics.rows[-1]["loss_scale"] == 1.0 and metrics.rows[-1]["skipped_steps"] == 2
    with pytest.raises(FP16OverflowError, match="overflowed 3 steps in a row at the minimum loss scale"):
        for cb in callbacks:
            cb.on_step_end(args, SimpleNamespace(global_step=3), None)
    assert [r["step"] for r in metrics.rows] == [1, 2]  # the step that stopped the run is not logged


def test_overflow_above_min_scale_is_only_logged(tmp_path):
    callbacks, metrics, args, _ = _callbacks(tmp_path, overflow=True, scale=1024.0)
    for step in range(1, 10):
        for cb in callbacks:
            cb.on_step_end(args, SimpleNamespace(global_step=step), None)
    assert metrics.rows[-1]["loss_scale"] == 1024.0 and metrics.rows[-1]["overflow"] is True


def test_non_finite_loss_stops_training_before_it_is_logged(tmp_path):
    callbacks, _, args, _ = _callbacks(tmp_path, overflow=False, scale=65536.0)

    def step(n: int, loss: float) -> None:
        state = SimpleNamespace(global_step=n, is_world_process_zero=True)
        for cb in callbacks:
            cb.on_step_end(args, state, None)
        for cb in callbacks:
            cb.on_log(args, state, None, logs={"loss": loss})

    step(1, 2.5)
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 2"):
        step(2, math.nan)
    assert [json.loads(x)["step"] for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [1]
