"""Global batch in tokens -> gradient accumulation, and the generated DeepSpeed config."""

import pytest

from zerotune.batch import BatchError, derive
from zerotune.config import load_recipe
from zerotune.ds_config import build


def test_llama8b_batch_arithmetic_on_one_and_four_nodes():
    r = load_recipe("llama8b_zero3")
    one = derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 8)
    assert one.global_batch_tokens == 62_914_560 == 1920 * 32_768
    assert one.grad_accum * one.tokens_per_micro_step == 62_914_560
    four = derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 32)
    assert four.grad_accum * 4 == one.grad_accum


def test_indivisible_batch_suggests_nearest_valid():
    with pytest.raises(BatchError, match=r"Nearest valid: 3,072 \(grad-accum 3\) or 4,096 \(grad-accum 4\)"):
        derive(3500, 256, 2, 2)


def test_deepspeed_config_leaves_trainer_values_auto():
    cfg = build(load_recipe("llama8b_zero3"))
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping"):
        assert cfg[key] == "auto"
    assert cfg["fp16"]["enabled"] == "auto" and cfg["bf16"]["enabled"] == "auto"
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["stage3_gather_16bit_weights_on_model_save"] is True
    assert z["sub_group_size"] == 100_000_000  # 0.4 GiB fp32 buffer instead of 3.7 GiB at the 1e9 default
    assert cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert "optimizer" not in cfg and "scheduler" not in cfg  # the Trainer owns them


def test_offload_recipe_merges_zero_overrides():
    z = build(load_recipe("llama8b_zero3_offload"))["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["stage"] == 3


def test_trainer_fills_the_autos_for_8_gpus():
    """transformers' own DeepSpeed integration resolves every 'auto' from the TrainingArguments."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    r = load_recipe("llama8b_zero3")
    bp = derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 8)
    hf = HfTrainerDeepSpeedConfig(build(r))
    args = SimpleNamespace(world_size=8, per_device_train_batch_size=1, gradient_accumulation_steps=bp.grad_accum,
                           max_grad_norm=1.0, learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                           weight_decay=0.0, fp16=True, bf16=False, fp16_backend="auto", fp16_opt_level="O1",
                           fp16_full_eval=False, bf16_full_eval=False, half_precision_backend="auto",
                           torch_compile=False, optim="adamw_torch", lr_scheduler_type="cosine", save_on_each_node=False)
    hf.trainer_config_process(args)
    c = hf.config
    assert c["train_batch_size"] * r.data.seq_len == 62_914_560
    assert c["gradient_accumulation_steps"] == bp.grad_accum and c["fp16"]["enabled"] is True


def test_an_epoch_counts_the_trainers_last_partial_accumulation_step():
    """The Trainer's epoch: ceil(ceil(n / micro) / world) micro-batches per rank, then ceil(that / GA) steps
    (accelerate pads ranks evenly; trainer.py num_update_steps_per_epoch). 1,000 rows on 16 ranks at GA 4: 63
    micro-batches per rank, 16 steps (the last of 3 micro-batches), not 1000 // 64 = 15 (which left 40 rows out)."""
    bp = derive(16 * 4 * 256, 256, 1, 16)
    assert bp.grad_accum == 4 and bp.steps_per_epoch(1000) == 16 and bp.total_steps(1000, 0, 2) == 32
    assert bp.steps_per_epoch(1024) == 16 and bp.total_steps(1000, 7, 2) == 7  # max_steps wins
