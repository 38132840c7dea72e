"""GGUF quantization types: one table for quantize, check, the planner and the recipe schema.

`producer`: llama.cpp's converter writes converter types directly; quantizer types go through an f16 GGUF and
llama.cpp's quantizer (`llama_model_quantize` with `ftype`, LLAMA_FTYPE in include/llama.h).
`tensor_type`: what every 2-D weight must be read back as (None for K-quants: a K-quant wherever the row
length is a multiple of 256, llama.cpp's per-tensor 32-block fallback elsewhere; gguf_checks reports those).
`bpw`: bits per weight for size planning (llama.cpp's block layouts; K-quant mixes as llama.cpp reports them
for Llama models). `max_kl` / `min_top1`: check's gates on mean KL(HF || GGUF) nats/token and top-1 agreement
on assistant tokens. Q8_0 and Q6_K are set from bench/bench_quant.py on the fine-tuned SmolLM2-135M
(docs/smollm2_demo.md, "Quantization on a real model"): mean KL about 3x the measured 6.0e-3 (Q8_0) and 1.4e-2 (Q6_K), top-1 at what
was measured less 0.02-0.05. The K-quant mixes keep tighter gates than SmolLM2 reaches on purpose: its width 576
is not a multiple of 256, so 166 of 211 matrices fall back to Q5_1/Q5_0 and the measured KL (0.14 Q5_K_M, 0.074
Q4_K_M, perplexity +11-13%) is a real loss that check should reject; Llama-3.1-8B's rows (4096, 14336) take
K-quants everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantType:
    producer: str               # "converter" or "quantizer"
    ftype: int | None           # LLAMA_FTYPE for the quantizer
    tensor_type: str | None     # GGUF type every 2-D weight must have; None = K-quant mix
    bpw: float                  # bits per weight
    max_kl: float               # check gate: mean KL(HF || GGUF), nats/token
    min_top1: float             # check gate: top-1 agreement on assistant tokens


QUANT_TYPES: dict[str, QuantType] = {
    "f32":    QuantType("converter", None, "F32", 32.0, 1e-4, 0.999),
    "f16":    QuantType("converter", None, "F16", 16.0, 1e-3, 0.99),
    "bf16":   QuantType("converter", None, "BF16", 16.0, 5e-3, 0.98),
    "q8_0":   QuantType("converter", None, "Q8_0", 8.5, 0.02, 0.98),
    "q6_k":   QuantType("quantizer", 18, None, 6.5625, 0.04, 0.95),
    "q5_k_m": QuantType("quantizer", 17, None, 5.69, 0.05, 0.93),
    "q5_k_s": QuantType("quantizer", 16, None, 5.54, 0.06, 0.92),
    "q5_1":   QuantType("quantizer", 9, "Q5_1", 6.0, 0.06, 0.92),
    "q5_0":   QuantType("quantizer", 8, "Q5_0", 5.5, 0.07, 0.91),
    "q4_k_m": QuantType("quantizer", 15, None, 4.85, 0.1, 0.9),
    "q4_k_s": QuantType("quantizer", 14, None, 4.58, 0.12, 0.88),
    "q4_1":   QuantType("quantizer", 3, "Q4_1", 5.0, 0.12, 0.88),
    "q4_0":   QuantType("quantizer", 2, "Q4_0", 4.5, 0.15, 0.86),
    "q3_k_m": QuantType("quantizer", 12, None, 3.91, 0.3, 0.8),
    "q2_k":   QuantType("quantizer", 10, None, 2.96, 0.6, 0.7),
}


def quant_type(name: str) -> QuantType:
    return QUANT_TYPES[name.lower()]
