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
    def loss_and_grads(model):
        model.zero_grad()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
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
""")


def test_liger_rope_and_fused_linear_cross_entropy_match_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["rope_patched"], "Liger's RoPE was not applied"
    assert res["flce_patched"], "Liger's fused linear cross entropy forward was not applied"
    assert res["liger"] == pytest.approx(res["ref"], rel=1e-5, abs=1e-5)
    assert res["max_grad_diff"] < 1e-4
