"""Assemble bench/results.md from the individual benchmark results, plus the GPU predictions.

    .venv/bin/python bench/report.py      # the last step of `make bench`

GPU figures come from zerotune's planner and the hardware limits in ../shared/NOTES.md; they are labelled
predictions, because no GPU is measured here.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "bench" / "results"
T4_BYTES_PER_S = 320e9  # T4 memory bandwidth: decode reads every weight once per token


def predictions() -> str:
    from zerotune.config import load_recipe
    from zerotune.plan import compute_plan

    p = compute_plan(load_recipe("llama8b_zero3"))
    t, q8 = p["time"], p["inference"]["quant"]["q8_0"]
    return "\n".join([
        "## GPU figures (predictions, not measurements)",
        "",
        f"- Llama-3.1-8B, `llama8b_zero3` on {p['cluster']['nodes']}x{p['cluster']['gpus_per_node']} "
        f"{p['cluster']['gpu_name']}: {t['flops_per_step']:.3g} FLOPs per {p['recipe_config']['global_batch_tokens']:,}-token "
        f"optimizer step; at {t['mfu']:.0%} MFU of the 125 TFLOPS fp16 peak that is "
        f"{t['seconds_per_step'] / 3600:.2f} h per step (`zerotune plan llama8b_zero3`).",
        f"- Predicted peak memory per GPU: {p['memory']['peak_bytes'] / 2**30:.2f} GiB of "
        f"{p['memory']['capacity_bytes'] / 2**30:.2f} GiB.",
        f"- Q8_0 GGUF: {q8['gguf_bytes'] / 2**30:.2f} GiB; T4 decode ceiling (320 GB/s / "
        f"{q8['gguf_bytes'] / 1e9:.2f} GB read per token): {T4_BYTES_PER_S / q8['gguf_bytes']:.1f} tokens/s.",
    ])


def planner_validation() -> str:
    """The planner's activation model against bytes measured on CPU (written by tests/test_activation_memory.py,
    which `make bench` runs just before)."""
    src = REPO / "runs" / "plan_validation.md"
    head = "## Planner: predicted vs measured activation memory\n\n"
    if not src.exists():
        return head + f"not run (tests/test_activation_memory.py did not write {src.relative_to(REPO)})\n"
    body = src.read_text().split("\n", 1)[1].strip()  # drop the file's own title
    return (head + body + "\n\nThe planner's model states come from DeepSpeed's own estimator "
            "(`estimate_zero3_model_states_mem_needs`); activations are the part it adds, validated here on "
            "transformers' Llama on CPU, whose SDPA kernel saves the same tensors as the memory-efficient kernel of the "
            "V100/T4 path. "
            "Checkpoint size is validated by tests/test_resume.py (tiny recipe within 0.05%).\n")


def main() -> int:
    parts = [f"# `make bench` results\n\n{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}. Ratios are measured side by side in one run; absolute numbers "
             "are context only.\n"]
    for name, title in (("train", None), ("data", None), ("inference", "## Inference (tiny model, same prompts)")):
        md = RESULTS / f"{name}.md"
        if not md.exists():
            parts.append(f"## {name}\n\nnot run (bench/bench_{name}.py did not write {md.name})\n")
            continue
        text = md.read_text().strip().replace("\n# ", "\n## ")
        text = "#" + text if text.startswith("# ") else (title + "\n\n" + text if title else text)
        parts.append(text + "\n")
        if (RESULTS / f"{name}.png").exists():
            parts.append(f"![{name}](results/{name}.png)\n")
    parts.append(planner_validation())
    parts.append(predictions() + "\n")
    out = REPO / "bench" / "results.md"
    out.write_text("\n".join(parts))
    print(f"bench: wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
