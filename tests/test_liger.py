"""Liger kernels equal the reference model where they can run on CPU (Triton's interpreter).

RoPE and fused linear cross entropy run under TRITON_INTERPRET=1; RMSNorm and SwiGLU do not
(the interpreter fails with "'float' object has no attribute 'to'"), so they are verified only on GPU.
Runs in a subprocess: TRITON_INTERPRET must be set before triton is imported, and Liger patches
transformers' Llama module globally.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

# loss and every gradient on `ids` with `labels`, as both scripts below compare them (with and without Liger)
LOSS_AND_GRADS = textwrap.dedent("""\
    def loss_and_grads(model):
        model.zero_grad()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}""")

SCRIPT = textwrap.dedent("""
    import json, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 512, (2, 48))
    labels = ids.clone(); labels[:, :10] = -100
    {LOSS_AND_GRADS}
    l0, g0 = loss_and_grads(ref)
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=True, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False,
                                cross_entropy=False)
    torch.manual_seed(0)
    patched = LlamaForCausalLM(cfg)
    patched.load_state_dict(ref.state_dict())
    l1, g1 = loss_and_grads(patched)
    gdiff = max((g0[n] - g1[n]).abs().max().item() for n in g0)
    import transformers.models.llama.modeling_llama as ml
    print(json.dumps({"ref": l0, "liger": l1, "max_grad_diff": gdiff,
                      "rope_patched": "liger" in ml.apply_rotary_pos_emb.__module__,
                      "flce_patched": "liger" in type(patched).forward.__module__}))
""").replace("{LOSS_AND_GRADS}", LOSS_AND_GRADS)


def test_liger_rope_and_fused_linear_cross_entropy_match_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["rope_patched"], "Liger's RoPE was not applied"
    assert res["flce_patched"], "Liger's fused linear cross entropy forward was not applied"
    assert res["liger"] == pytest.approx(res["ref"], rel=1e-5, abs=1e-5)
    assert res["max_grad_diff"] < 1e-4


PHASES = textwrap.dedent("""
    import json, torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=True, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False,
                                cross_entropy=False)
    from transformers import LlamaConfig, LlamaForCausalLM
    from zerotune.train.validation import nll_sum
    from zerotune.safety import liger_saved_head_grad

    S, V = 128, 2048
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)

    class Largest(TorchDispatchMode):  # the largest tensor any op creates while the mode is on
        def __init__(self):
            super().__init__()
            self.numel, self.shape = 0, None
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.shape = t.numel(), list(t.shape)
            return out

    ids = torch.randint(0, V, (1, S))
    pos = torch.cat([torch.arange(S // 2), torch.arange(S - S // 2)]).unsqueeze(0)  # two packed documents
    labels = ids.clone(); labels[:, :8] = -100
    row = {"input_ids": ids[0].tolist(), "labels": labels[0].tolist(), "position_ids": pos[0].tolist()}
    res = {}
    model.train()
    with Largest() as m:
        out = model(input_ids=ids, labels=labels, position_ids=pos)
        out.loss.backward()
    res["train_step"] = m.shape
    g = liger_saved_head_grad(model(input_ids=ids, labels=labels, position_ids=pos))
    res["saved_head_grad"] = [list(g.shape), bool(torch.isfinite(g).all())] if g is not None else None
    model.eval()
    with torch.no_grad():
        for liger in (True, False):
            with Largest() as m:
                loss, n = nll_sum(model, [row], torch.device("cpu"), liger=liger)
            res[f"validation_liger_{liger}"] = [m.shape, loss, n]
        with Largest() as m:
            model.generate(input_ids=ids[:, : S - 8], max_new_tokens=4, do_sample=False, use_cache=True,
                           pad_token_id=0)
        res["samples"] = m.shape
    model.half().train()  # fp16 as on a V100; summed loss as the Trainer's (num_items_in_batch)
    with torch.no_grad():  # hidden states of ~2000, one target for 120 tokens: its lm_head row sums them all,
        model.model.norm.weight.fill_(2000.0)  # past fp16's 65504 before any loss scaling
    one_target = torch.where(labels == -100, labels, torch.zeros_like(labels))
    g = liger_saved_head_grad(model(input_ids=ids, labels=one_target, position_ids=pos,
                                    num_items_in_batch=torch.tensor(1.0)))
    res["overflowed_head_grad_finite"] = bool(torch.isfinite(g).all())
    print(json.dumps(res))
""")


def test_liger_on_no_phase_allocates_a_sequence_by_vocabulary_tensor():
    """Issue 29: with Liger on, neither the training step nor the in-training validation (eval mode, where Liger
    materialises logits unless asked not to) nor sample generation creates a sequence x vocabulary tensor; the
    same probe does see one when validation runs without the fused loss, so it can fail. Also: the lm_head
    gradient Liger saves in forward (before loss scaling) is found in the graph, and its overflow is seen."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    S, V = 128, 2048

    def numel(shape):
        n = 1
        for d in shape:
            n *= d
        return n

    # the largest left are weight-sized (V x H = S x V / 2 here: the embedding, Liger's lm_head gradient)
    assert numel(res["train_step"]) <= V * 64 < S * V, res["train_step"]
    assert numel(res["validation_liger_True"][0]) <= V * 64, res["validation_liger_True"]
    assert numel(res["validation_liger_False"][0]) >= S * V, res["validation_liger_False"]  # the probe sees logits
    # the fused loss in eval mode is the same number as the materialised one
    assert res["validation_liger_True"][1] == pytest.approx(res["validation_liger_False"][1], rel=1e-4)
    assert res["validation_liger_True"][2] == res["validation_liger_False"][2] == S - 8
    assert numel(res["samples"]) <= V * 64, res["samples"]
    assert res["saved_head_grad"] == [[V, 64], True]
    assert res["overflowed_head_grad_finite"] is False


FAMILY_SCRIPT = textwrap.dedent("""
    import json, torch, transformers as tf
    from zerotune.families import FAMILIES
    builds = {
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=32, layer_types=["sliding_attention", "full_attention"],
            use_cache=False)),
    }
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.clone(); labels[:, :10] = -100
    {LOSS_AND_GRADS}
    res = {}
    for name, build in builds.items():
        torch.manual_seed(0)
        ref = build()
        l0, g0 = loss_and_grads(ref)
        f = FAMILIES[name]
        # the family's own patch function and kernel names, with the ones the interpreter cannot run turned off
        kw = {k: (v if k in ("rope", "fused_linear_cross_entropy", "cross_entropy") else False)
              for k, v in f.liger_kernels.items()}
        f.liger_function()(**kw)
        torch.manual_seed(0)
        patched = build()
        patched.load_state_dict(ref.state_dict())
        l1, g1 = loss_and_grads(patched)
        res[name] = {"ref": l0, "liger": l1, "max_grad_diff": max((g0[n] - g1[n]).abs().max().item() for n in g0),
                     "flce_patched": "liger" in type(patched).forward.__module__}
    print(json.dumps(res))
""").replace("{LOSS_AND_GRADS}", LOSS_AND_GRADS)


def test_each_familys_liger_patch_matches_reference():
    """families.py's Liger function for Qwen3 and Gemma 3 (RoPE and fused linear cross entropy, the kernels the
    interpreter runs): same loss and gradients as the unpatched model; Gemma 3's tied lm_head and sliding layers."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", FAMILY_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["flce_patched"], name
        assert r["liger"] == pytest.approx(r["ref"], rel=1e-5, abs=1e-5), (name, r)
        assert r["max_grad_diff"] < 1e-4, (name, r)
