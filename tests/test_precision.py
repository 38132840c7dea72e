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
from zerotune.safety import FP16OverflowError, LmHeadOverflow, SafetyChecks, scaler_gave_up


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
    assert fp16["initial_scale_power"] == 16 + min(8, bp.grad_accum.bit_length() - 1)  # floor(log2 GA), capped
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


# ------------------------------------------------------------------------------ item 4: Liger fused CE below sm80

def _shape8b():
    from zerotune.planner.target import model_shape

    return model_shape(load_recipe("llama8b_zero3"))


@pytest.mark.parametrize("cap, expected", [((7, 0), 128_256 * 4096 * 6), ((7, 5), 128_256 * 4096 * 6),
                                           ((8, 0), 0), (None, 0)])
def test_liger_fallback_transient_follows_capability(cap, expected):
    from zerotune.hardware import gpu_for_capability
    from zerotune.planner.memory import liger_fallback_bytes

    g = gpu_for_capability(cap)
    assert liger_fallback_bytes(_shape8b(), 2, True, g.capability, lm_head_trainable=True) == expected
    # a frozen lm_head (LoRA, QLoRA) gets no gradient from Liger at all; fp32 never takes the 16-bit path
    assert liger_fallback_bytes(_shape8b(), 2, True, g.capability, lm_head_trainable=False) == 0
    assert liger_fallback_bytes(_shape8b(), 4, True, g.capability, lm_head_trainable=True) == 0


@pytest.mark.parametrize("seq", [2048, 16384])
def test_planner_counts_the_fallback_beyond_the_backward_recompute(seq):
    """The transient lives at the end of forward, the recompute in backward: only the excess adds up. 8B on
    8 V100s: 2.94 GiB fallback vs a 3.38 GiB recompute at 16K (covered), 0.42 GiB at 2K (2.5 GiB more)."""
    from zerotune.planner.memory import memory_breakdown

    r = load_recipe("llama8b_zero3")
    kw = dict(seq=seq, micro=1, precision="fp16", attention="sdpa", liger=True, checkpointing=True, packing=True,
              zero=build(r)["zero_optimization"], gpus_per_node=8, nodes=1)
    v100, a100 = memory_breakdown(_shape8b(), capability=(7, 0), **kw), memory_breakdown(_shape8b(), capability=(8, 0), **kw)
    extra = v100["parts"]["logits + loss"] - a100["parts"]["logits + loss"]
    assert extra == max(0, 128_256 * 4096 * 6 - v100["parts"]["one-layer recompute"])
    assert (extra > 2 * 2**30) == (seq == 2048)
    assert "sm<80 fallback transient 2.94 GiB" in v100["logits_how"]


def test_choice_keeps_liger_below_sm80_and_says_what_it_costs():
    from zerotune.hardware import choose, gpu_for_capability

    v100 = choose(gpu_for_capability((7, 0)), fa2_installed=False)
    assert v100.liger and v100.precision == "fp16"
    assert any("below sm80" in w and "fp16" in w for w in v100.reasons)
    assert not any("below sm80" in w for w in choose(gpu_for_capability((8, 0)), fa2_installed=False).reasons)


def _fp16_engine(scale: float, overflow: bool):
    """What StepMetrics and SafetyChecks read of DeepSpeed's engine (metrics.fp16_scaler): the fp16 optimizer's
    scale and overflow flag (deepspeed 0.19.8 runtime/zero/stage3.py `loss_scale` property, `overflow`;
    engine.skipped_steps; the fp16 config)."""
    return SimpleNamespace(skipped_steps=0, config={"fp16": {"min_loss_scale": 1}},
                           optimizer=SimpleNamespace(loss_scale=scale, overflow=overflow))


def test_lm_head_overflow_that_the_loss_scaler_resolves_does_not_stop_the_run(tmp_path):
    """An inf in lm_head's (loss-scaled) gradient is ordinary fp16 overflow while the scale can still drop:
    DeepSpeed skips the step and halves the scale on the second overflow (hysteresis 2). Issue 29 item 3: the
    old guard raised on that second step, before its save, and the job was not requeued."""
    model = _tiny_llama(torch.float32)
    safety = SafetyChecks(max_overflows_at_min_scale=5)
    cb = StepMetrics(tmp_path / "m.jsonl", tokens_per_step=64, label_fraction=1.0, flops_tok=1.0,
                     peak_tflops=None, world_size=1, safety=safety)
    safety.watch_lm_head(model)
    args, x = SimpleNamespace(fp16=True, device=torch.device("cpu")), torch.randint(0, 128, (2, 32))
    w = model.get_output_embeddings().weight
    scale = 65536.0
    for step in range(1, 7):  # overflow, overflow (halved), ... as DeepSpeed's scaler would go
        eng = _fp16_engine(scale, overflow=step <= 4)
        safety.trainer = cb.trainer = SimpleNamespace(model_wrapped=eng)
        model.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        (loss + ((w * float("inf")).sum() if step <= 4 else 0)).backward()
        for callback in (safety, cb):  # the worker's order
            callback.on_step_end(args, SimpleNamespace(global_step=step), None)
        if step % 2 == 0 and step <= 4:
            scale /= 2
    assert [r["lm_head_grad_nonfinite"] for r in cb.rows] == [1, 1, 1, 1, 0, 0]
    assert [r["lm_head_grad_nonfinite_unscaled"] for r in cb.rows] == [0] * 6  # no Liger here: nothing before scaling


def test_overflow_at_deepspeeds_minimum_scale_stops_the_run_in_our_words():
    """One that persists down to the minimum scale stops the run: DeepSpeed's real scaler raises inside
    optimizer.step (before any callback), and the worker re-raises it as FP16OverflowError with what to do."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)  # hysteresis spent, at fp16.min_loss_scale
    with pytest.raises(Exception) as caught:
        scaler.update_scale(True)
    err = scaler_gave_up(caught.value)
    assert isinstance(err, FP16OverflowError) and "minimum loss scale" in str(err) and "train.lr" in str(err)
    assert scaler_gave_up(RuntimeError("CUDA out of memory")) is None


def test_lm_head_gradient_non_finite_before_scaling_stops_at_once():
    """Liger's own gradient (saved in forward, before the loss scale) non-finite in two steps: no scale can cure it."""
    policy = SafetyChecks(max_overflows_at_min_scale=5).lm_head
    assert isinstance(policy, LmHeadOverflow) and policy.steps == 2
    policy.check(1, step=1)  # one micro-batch in step 1 (its loss scale, 65536, is not at the minimum)
    with pytest.raises(FP16OverflowError, match="before loss scaling in 2 steps in a row"):
        policy.check(1, step=2)


LIGER_FP16 = """
import json, torch
from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
torch.manual_seed(0)
V, H, BT = 256, 64, 512
out = {}
for scale in (1.0, 300.0):
    x = (torch.randn(BT, H).abs() * scale).half().requires_grad_()
    w = torch.randn(V, H).half().requires_grad_()
    y = torch.zeros(BT, dtype=torch.long)  # one target for every token: its lm_head row sums all BT terms
    loss = liger_fused_linear_cross_entropy(x, w, y, reduction="sum")  # reduction "sum": as with num_items_in_batch
    loss.backward()
    out[str(scale)] = {"loss_finite": bool(torch.isfinite(loss).item()), "head_finite": bool(torch.isfinite(w.grad).all()),
                       "input_finite": bool(torch.isfinite(x.grad).all())}
print(json.dumps(out))
"""


@pytest.mark.integration  # a subprocess under Triton's interpreter: about 20 s
def test_liger_fp16_lm_head_gradient_overflows_silently():
    """The real kernel (Triton's interpreter on CPU takes the same non-addmm path as sm<80): 512 tokens of
    |x| ~ 300 with one target sum past fp16's 65,504 in grad_weight while the loss and input gradient stay
    finite, i.e. nothing but a check on lm_head's gradient sees it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", LIGER_FP16], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["1.0"] == {"loss_finite": True, "head_finite": True, "input_finite": True}
    assert out["300.0"] == {"loss_finite": True, "head_finite": False, "input_finite": True}


# ------------------------------------------------------------------------------ item 7: QLoRA's fp32 upcasts

def test_qlora_counts_fp32_embeddings_and_residual_stream():
    """peft 0.21.2 prepare_model_for_kbit_training casts every non-4-bit 16-bit parameter to fp32
    (peft/utils/other.py:204-209): embeddings, lm_head, norms. The residual stream is then fp32 too."""
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.memory import activation_bytes
    from zerotune.planner.target import model_shape

    r = load_recipe("llama8b_qlora_t4")
    m = model_shape(r)
    p = compute_plan(r)
    states = p.memory.parts["model states (DeepSpeed estimator)"]
    assert states > 4 * 2 * 128_256 * 4096  # both 128K x 4096 matrices at 4 B (3.9 GiB of the 7.9)
    fp32 = activation_bytes(m, 1, 2048, 2, "sdpa", True, True, True, residual_bytes=4)
    fp16 = activation_bytes(m, 1, 2048, 2, "sdpa", True, True, True)
    assert fp32["layer_inputs"] == 2 * fp16["layer_inputs"] == 32 * 2048 * 4096 * 4
    assert p.memory.parts["checkpointed layer inputs"] >= fp32["layer_inputs"]
    # Still fits a T4 (about 10.9 GiB predicted of 15) at the recipe's 2,048 x 1; 4,096 x 2 does not.
    assert p.recipe_batch.fits
    assert not next(o for o in p.options if (o.seq_len, o.micro_batch_size) == (4096, 2)).fits


def test_prepare_model_for_kbit_training_makes_the_residual_stream_fp32(tmp_path):
    """The premise of the planner's QLoRA activation term, on the real components: a 4-bit (bitsandbytes, CPU)
    tiny Llama loaded in 16-bit, after peft's prepare_model_for_kbit_training, feeds fp32 into every layer."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _tiny_llama(torch.float32).save_pretrained(tmp_path / "m")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=q, dtype=torch.bfloat16)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert model.get_input_embeddings().weight.dtype == model.get_output_embeddings().weight.dtype == torch.float32
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    model(input_ids=torch.randint(0, 128, (1, 16)))
    assert seen == [torch.float32] * len(model.model.layers)


@pytest.mark.integration
def test_zero_gradient_fraction_under_zero3_on_two_ranks(tiny_trained_20):
    """The hooks see ZeRO-3's partitioned parameters' gradients (the session's shared 20-step tiny run): the metric
    is in every logged row and line; fp32 on CPU, so it is ~0."""
    from conftest import read_metrics

    out, log = tiny_trained_20
    rows = read_metrics(out)
    assert rows and all(0 <= r["grad_zero_frac"] < 0.01 for r in rows)
    assert log.count("zero grads") == len(rows)


def test_fp16_without_deepspeed_gets_the_same_scale_rule():
    """QLoRA on a T4 (GA 16, no DeepSpeed): torch's GradScaler from the same rule instead of accelerate's 2^16 /
    2,000-step default. The swap into the Trainer's accelerator needs a GPU; the scaler itself is built here."""
    from zerotune.ds_config import amp_grad_scaler

    s = amp_grad_scaler(16, 300, device="cpu")
    assert s.get_scale() == 2.0 ** 20 and s.get_growth_interval() == 30


def test_a_pair_objective_starts_with_the_headroom_sft_has():
    """Issue 53 (2): the scale is DeepSpeed's 2^16 over what a micro-step weighs on its label tokens' log-probs
    (ds_config.micro_step_weight), not over 1/GA alone: a DPO token weighs beta x sigma / (pairs x GA), several times
    an SFT token's at the same GA, and fp16's gradient would overflow in the first steps under SFT's scale."""
    from zerotune.ds_config import micro_step_weight

    r = load_recipe("llama8b_dpo_zero3")  # beta 0.01, no NLL term
    bp = derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 8, 2)
    ga = bp.grad_accum
    for beta, alpha, labels in ((0.01, 0.0, 300), (0.1, 0.0, 300), (0.1, 0.5, 800)):
        rr = load_recipe("llama8b_dpo_zero3", [f"preference.beta={beta}", f"preference.nll_alpha={alpha}"])
        w = micro_step_weight(rr, ga, labels)
        assert w == pytest.approx((beta * 0.5 * 2 * labels + 2 * alpha) / ga)  # the formula, per label token
        power, _ = loss_scale(ga, 100, w)
        # the headroom a mean-normalised micro-batch has at DeepSpeed's 2^16, rounded down to a power of two
        assert 2 ** 15 < 2 ** power * w <= 2 ** 16, (beta, alpha, labels, power)
        assert build(rr, bp, 100, label_tokens_per_row=labels)["fp16"]["initial_scale_power"] == power
    # SFT's rule at this GA (2^20) would start beta 0.1's 300-token rows 2^20 x 1.875 = 30x past that headroom
    sft_power = loss_scale(ga, 100)[0]
    w = micro_step_weight(load_recipe("llama8b_dpo_zero3", ["preference.beta=0.1"]), ga, 300)
    assert sft_power == 20 and 2 ** sft_power * w > 16 * 2 ** 16 and loss_scale(ga, 100, w)[0] == 15
    assert micro_step_weight(load_recipe("llama8b_zero3"), 480) == 1 / 480  # SFT: 1 / GA, as before


def test_the_v100_attention_backward_temporaries_are_planned():
    """Issue 53 (6): on sm70 at head_dim 128 torch's memory-efficient backward computes delta outside its kernel
    (kernel_backward.h kKernelComputesDelta; attention_backward.cu: fp32 dO x O): 12 B per query-token element,
    in the attention's backward, after the layer's MLP freed what it saved. Not on sm80, not at head_dim 64 in fp16
    (the output stays in registers); fp32 inputs (Gemma 3 on a V100) pay only the product."""
    from zerotune.planner.memory import sm70_attention_backward_bytes
    from zerotune.planner.target import model_shape

    m8 = model_shape(load_recipe("llama8b_zero3"))  # head_dim 128
    smol = model_shape(load_recipe("smollm2"))      # head_dim 64
    t = 16384
    assert sm70_attention_backward_bytes(m8, t, 2, "sdpa_docs", (7, 0)) == 12 * t * 4096
    assert sm70_attention_backward_bytes(m8, t, 2, "sdpa_docs", (8, 0)) == 0
    assert sm70_attention_backward_bytes(m8, t, 2, "flash_attention_2", (7, 0)) == 0
    assert sm70_attention_backward_bytes(smol, t, 2, "sdpa", (7, 0)) == 0
    assert sm70_attention_backward_bytes(smol, t, 4, "sdpa", (7, 0)) == 4 * t * smol.q_dim
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.report import format_plan

    p = compute_plan(load_recipe("llama8b_zero3"))
    m = p.memory
    assert m.sm70_delta_bytes == 12 * 16384 * 4096 and m.mlp_saved_bytes > m.sm70_delta_bytes
    assert m.parts["sm70 attention backward (beyond MLP)"] == 0 and m.fits
    assert "may compute delta outside the kernel here (if its 64x64 variant runs; unverified on a V100) (fp32 dO, O and their product, 0.75 GiB)" in format_plan(p)
