"""Verify a saved model: parameter count, no empty tensors, reload gives the same logits.

ZeRO-3 saves can silently be empty or tiny (DeepSpeed #3841, LLaMA-Factory #253).
"""

from __future__ import annotations

from pathlib import Path


class SaveVerificationError(RuntimeError):
    pass


def verify_saved_model(folder: Path, expected_params: int, probe: dict, ref_logits, precision: str) -> dict:
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
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v.cpu() for k, v in probe.items()}).logits.float()
    diff = (logits - ref_logits).abs().max().item()
    tol = 1e-3 if precision == "fp32" else 5e-2 * max(1.0, ref_logits.abs().max().item())
    if diff > tol:
        raise SaveVerificationError(f"{folder}: reloaded model's logits differ from the trained model's by {diff:.3g} "
                                    f"(tolerance {tol:.3g}).")
    return {"params": n, "files": [f.name for f in files], "max_abs_logit_diff": diff}
