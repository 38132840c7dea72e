"""Verify a saved model: parameter count, no empty tensors, reload gives the same logits on a short probe.

ZeRO-3 saves can silently be empty or tiny (DeepSpeed #3841, LLaMA-Factory #253).

The probe is the first PROBE_TOKENS tokens of the first training row, whatever data.seq_len is: a
save that lost or scrambled weights changes every position's logits, so a few hundred positions
verify it as well as a whole packed row, and the probe costs the same at 512 and at 16,384 tokens.
The reference logits are stored in the training dtype: PROBE_TOKENS x vocab x 2 bytes under
fp16/bf16 (256 x 128,256 x 2 = 65.7 MB at Llama-3.1-8B), bounded because neither factor depends
on seq_len (a whole 16K row in fp32 was 8.4 GB).

One rule for dtypes (`model_dtype`): finalize loads, merges, saves and reloads in the precision the
run trained in: fp16/bf16 on GPUs (8B: 16 GB of host RAM per copy, not 32), fp32 for CPU runs.
"""

from __future__ import annotations

from pathlib import Path

from .attention import load_name
from .hardware import dtype_bytes

PROBE_TOKENS = 256


class SaveVerificationError(RuntimeError):
    pass


def model_dtype(precision: str):
    """The dtype finalize holds the model in: the training precision (fp32 on CPU runs)."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def probe_inputs(batch: dict) -> dict:
    """The verification probe: the first PROBE_TOKENS positions of one collated row, labels dropped.
    Causal attention (block-causal with packed position_ids) makes a prefix's logits independent of
    what follows, so the prefix of a trained row is a valid probe on its own."""
    return {k: v[:1, :PROBE_TOKENS] for k, v in batch.items() if k != "labels"}


def probe_bytes(vocab: int, precision: str, tokens: int = PROBE_TOKENS) -> int:
    """Size of the stored reference logits."""
    return tokens * vocab * dtype_bytes(precision)


def logit_tolerance(precision: str, ref_logits) -> float:
    """Max |logit diff| accepted between the trained model and a reload: tight in fp32, relative in 16-bit
    (one fp16 rounding of each weight and a different kernel order move logits by ~1e-2 of their scale)."""
    return 1e-3 if precision == "fp32" else 5e-2 * max(1.0, ref_logits.float().abs().max().item())


def compare_logits(logits, ref_logits) -> dict:
    """Max |diff| and how often the top-1 token agrees, on the probe positions."""
    a, b = logits.float(), ref_logits.float()
    return {"max_abs_logit_diff": (a - b).abs().max().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def verify_saved_model(folder: Path, expected_params: int, probe: dict, ref_logits, precision: str,
                       attention: str = "sdpa") -> dict:
    """attention: the kernel training ran (attention.py's sdpa_docs on packed rows), so the probe's packed prefix
    takes the same path on reload."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SaveVerificationError(f"{folder}: no safetensors files were written.")
    n, empty = 0, []
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                numel = 1
                for d in shape:
                    numel *= d
                if numel == 0:
                    empty.append(k)
                n += numel
    if empty:
        raise SaveVerificationError(f"{folder}: empty tensors in the saved model: {empty[:5]} (DeepSpeed #3841).")
    if n != expected_params:
        raise SaveVerificationError(f"{folder}: saved {n:,} parameters, the model has {expected_params:,}.")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=model_dtype(precision),
                                                 attn_implementation=load_name(attention))
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v.cpu() for k, v in probe.items()}, use_cache=False).logits
    del model
    cmp = compare_logits(logits, ref_logits)
    tol = logit_tolerance(precision, ref_logits)
    if cmp["max_abs_logit_diff"] > tol:
        raise SaveVerificationError(f"{folder}: reloaded model's logits differ from the trained model's by "
                                    f"{cmp['max_abs_logit_diff']:.3g} (tolerance {tol:.3g}; top-1 agrees on "
                                    f"{cmp['top1_agreement']:.0%} of {logits.shape[1]} probe tokens).")
    return {"params": n, "files": [f.name for f in files], "probe_tokens": int(logits.shape[1]), **cmp}
