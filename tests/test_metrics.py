"""What StepMetrics measures and logs per optimizer step: the row in metrics.jsonl, MFU, label tokens.
(Stopping the run is safety.py's: tests/test_safety.py.)"""

import json
from types import SimpleNamespace

import pytest
import torch

from zerotune.metrics import StepMetrics, flops_per_token


def test_a_logged_step_is_one_row_with_throughput(tmp_path):
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=1024, label_fraction=0.25, flops_tok=1e6,
                     peak_tflops=125.0, world_size=2)
    args = SimpleNamespace(fp16=False, device=torch.device("cpu"))
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    cb.on_step_begin(args, state, None)
    sum(range(100_000))  # a measurable step time
    cb.on_step_end(args, state, None)
    cb.on_log(args, state, None, logs={"loss": 2.5, "grad_norm": 1.0, "learning_rate": 1e-5})
    row = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert row["loss"] == 2.5 and row["mfu"] > 0 and row["tokens_per_s"] > 0
    assert row["label_tokens"] == 256  # not counted (no count_labels): the data set's fraction


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


def test_tokens_and_mfu_are_what_the_micro_batches_processed(tmp_path):
    """Issue 53 (1): tokens/s and MFU from what each micro-batch carried, not the planned bound: a DPO pair row
    right-padded to its own length is not 2 x seq_len, and a packed row's documents attend to themselves, not to the
    whole row. Two micro-batches: a packed row of documents 10 + 6, and two padded rows of 12."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotune.metrics import attention_squares

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)).train()
    shape = (1000, 1, 32)  # (parameters, layers, hidden): any numbers the formula can be checked against
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=4096, label_fraction=1.0, flops_tok=1e9,
                     peak_tflops=1e-6, world_size=1)  # a peak of 1 MFLOP/s: the MFU a few units, not rounded away
    cb.count_labels(model, shape)
    packed = torch.randint(0, 64, (1, 16))
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    assert attention_squares(packed, pos) == 10 ** 2 + 6 ** 2 and attention_squares(packed) == 16 ** 2
    model(input_ids=packed, position_ids=pos, labels=packed)
    padded = torch.randint(0, 64, (2, 12))
    model(input_ids=padded, labels=padded)
    args, state = SimpleNamespace(fp16=False, device=torch.device("cpu")), SimpleNamespace(global_step=1)
    cb.on_step_begin(args, state, None)
    sum(range(3_000_000))  # tens of ms: step_time_s is rounded to 0.1 ms
    cb.on_step_end(args, state, None)
    row = cb.rows[-1]
    tokens, squares = 16 + 24, 10 ** 2 + 6 ** 2 + 2 * 12 ** 2
    assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"], rel=1e-2)  # not 4096 / step
    flops = 6 * 1000 * tokens + 6 * 1 * 32 * squares
    assert row["mfu"] == pytest.approx(flops / row["step_time_s"] / 1e6, rel=1e-2)
