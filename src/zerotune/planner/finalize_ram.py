"""Host RAM of finalize (train.finalize, adapters.finalize_peft): the peak on rank 0's node after training.

Finalize runs after the trainer is freed and the other ranks have exited, in one CPU process that holds
the model in the training dtype (`verify.model_dtype`). It keeps one copy of the model at a time: the
merged copy is freed before the saved one is reloaded for verification, and safetensors writes straight
from the tensors' memory (safetensors/torch.py save_file -> _flatten_as_ptr: no serialised copy). So the
peak is the merge phase: the 16-bit base, the adapter (peft upcasts adapter weights to fp32 by default,
autocast_adapter_dtype=True), and one linear's merge temporaries (peft lora/layer.py get_delta_weight
computes B @ A in fp32 on CPU for 16-bit weights, then casts it to the weight's dtype).
"""

from __future__ import annotations

from ..hardware import dtype_bytes
from ..verify import probe_bytes
from .memory import GiB, ModelShape

INTERPRETER_BYTES = GiB  # python + torch + transformers + peft imported: 0.54 GB RSS measured here; + slack


def finalize_host_bytes(m: ModelShape, precision: str, peft: tuple[str, int] | None) -> dict:
    """Peak host bytes of finalize; `peft` is (method, trainable params) or None for full fine-tuning."""
    b = dtype_bytes(precision)
    parts = {f"model, {8 * b}-bit (one copy at a time)": m.n_params * b}
    if peft is not None:
        _, trainable = peft
        parts["adapter, fp32"] = 4 * trainable
        parts["merge temporaries (largest linear)"] = m.intermediate * m.hidden * (4 + b)
    parts["probe logits (reference, reloaded, fp32 compare)"] = 3 * probe_bytes(m.vocab, "fp32")
    parts["interpreter + libraries"] = INTERPRETER_BYTES
    return {"parts": parts, "peak_bytes": sum(parts.values())}
