"""Quantization on a real distribution: each GGUF type of the fine-tuned SmolLM2 model against the HF model.

    make bench-quant      # trains smollm2 if needed, then .venv/bin/python bench/bench_quant.py smollm2

For Q8_0, Q6_K, Q5_K_M and Q4_K_M (and F16 as the reference point): llama.cpp's converter / quantizer through
zerotune's own quantize stage (so every file passes the same read-back checks), then check's own measurements:
mean KL(HF || GGUF) per token and top-1 agreement over held-out documents of the eval split, the perplexity
ratio, and the task score (the recipe's first eval set, scored by its scorer, greedy through the GGUF's
embedded chat template). Also which tensors fell back to another type: SmolLM2's width 576 is 2.25 x 256, so
rows of that length cannot use a 256-block K-quant and llama.cpp picks a 32-block type per tensor.
Writes bench/results/quant.json and quant.md. check's per-type gates (src/zerotune/quant_types.py) are set
from these numbers with headroom; the README says how.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

TYPES = ["f16", "q6_k", "q5_k_m", "q4_k_m", "q8_0"]  # q8_0 last: the recipe's own GGUF and manifest stay
RESULTS = REPO / "bench" / "results"


def main(recipe: str = "smollm2") -> None:
    from zerotune.answering import gguf_answers, load_gguf, load_rows
    from zerotune.check import heldout_documents, logit_agreement
    from zerotune.config import load_recipe
    from zerotune.gguf_checks import read_header
    from zerotune.layout import layout
    from zerotune.quantize import quantize
    from zerotune.scorers import score

    rows_out = []
    for qtype in TYPES:
        r = load_recipe(recipe, [f"quantize.type={qtype}", f"output_dir=runs/{recipe}"])
        t0 = time.time()
        manifest = quantize(r)
        gguf = layout(r).gguf
        types: dict[str, int] = {}
        for t in read_header(gguf).tensors:
            types[t.type_name] = types.get(t.type_name, 0) + 1
        task = r.eval_sets()[0]
        rows = load_rows(task)
        llm = load_gguf(gguf, n_ctx=2048)
        try:
            answers, _ = gguf_answers(llm, rows, task.max_new_tokens)
            agreement = logit_agreement(llm, layout(r).model, heldout_documents(r, r.check.n_kl_texts))
        finally:
            llm.close()
        task_score = sum(score(task.scorer, a, row) for a, row in zip(answers, rows)) / len(rows)
        row = {"type": qtype, "mib": round(manifest["bytes"] / 2**20, 1), "tensor_types": types,
               "k_quant_fallbacks": len(manifest["checks"]["k_quant_fallbacks"]),
               "mean_kl": agreement["mean_kl"], "top1": agreement["top1_agreement"],
               "top1_labels": agreement["top1_agreement_labels"], "ppl_ratio": agreement["ppl_ratio"],
               "positions": agreement["positions"], "task": task.name, "task_score": task_score,
               "n_task": len(rows), "seconds": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        if qtype != "q8_0":
            gguf.unlink()  # keep the recipe's own Q8_0 only
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant.json").write_text(json.dumps(rows_out, indent=1))
    lines = [f"| type | MiB | tensor types | mean KL (nats/token) | top-1 (all / assistant) | perplexity ratio | "
             f"{rows_out[0]['task']} score |", "|---|---|---|---|---|---|---|"]
    for x in rows_out:
        tt = ", ".join(f"{k} {v}" for k, v in sorted(x["tensor_types"].items()))
        lines.append(f"| {x['type']} | {x['mib']} | {tt} | {x['mean_kl']:.2e} | {x['top1']:.4f} / "
                     f"{x['top1_labels']:.4f} | {x['ppl_ratio']:.4f} | {x['task_score']:.3f} |")
    (RESULTS / "quant.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
