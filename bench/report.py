"""Assemble bench/results.md from the individual benchmark results, plus the GPU predictions.

    .venv/bin/python bench/report.py      # the last step of `make bench`

GPU figures come from zerotune's planner and the hardware limits in ../shared/NOTES.md; they are labelled
predictions, because no GPU is measured here.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from pathlib import Path

from bench_env import REPO, RESULTS  # first: the hub offline, src/ on the path

from bench_stats import ratio_stats  # noqa: E402
from zerotune import manifest as mf  # noqa: E402

T4_BYTES_PER_S = 320e9  # T4 memory bandwidth: decode reads every weight once per token


def predictions() -> str:
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan

    p = compute_plan(load_recipe("llama8b_zero3"))
    t, q8 = p.time, p.inference.of("q8_0")
    return "\n".join([
        "## GPU figures (predictions, not measurements)",
        "",
        f"- Llama-3.1-8B, `llama8b_zero3` on {p.cluster.nodes}x{p.cluster.gpus_per_node} "
        f"{p.cluster.gpu_name}: {t.flops_per_step:.3g} FLOPs per {p.recipe_batch.global_batch_tokens:,}-token "
        f"optimizer step; at {t.mfu:.0%} MFU of the 125 TFLOPS fp16 peak that is "
        f"{t.seconds_per_step / 3600:.2f} h per step (`zerotune plan llama8b_zero3`).",
        f"- Predicted peak memory per GPU: {p.memory.peak_bytes / 2**30:.2f} GiB of "
        f"{p.memory.capacity_bytes / 2**30:.2f} GiB.",
        f"- Q8_0 GGUF: {q8.gguf_bytes / 2**30:.2f} GiB; T4 decode ceiling (320 GB/s / "
        f"{q8.gguf_bytes / 1e9:.2f} GB read per token): {T4_BYTES_PER_S / q8.gguf_bytes:.1f} tokens/s.",
    ])


def planner_validation() -> str:
    """The planner's activation model against bytes measured on CPU (written by tests/test_activation_memory.py,
    which `make bench` runs just before)."""
    src = RESULTS / "plan_validation.md"
    head = "## Planner: predicted vs measured activation memory\n\n"
    if not src.exists():
        return head + f"not run (tests/test_activation_memory.py did not write {src.relative_to(REPO)})\n"
    body = src.read_text().split("\n", 1)[1].strip()  # drop the file's own title
    return (head + body + "\n\nThe planner's model states come from DeepSpeed's own estimator "
            "(`estimate_zero3_model_states_mem_needs`); activations are the part it adds, validated here on "
            "transformers' Llama on CPU, whose SDPA kernel saves the same tensors as the memory-efficient kernel of the "
            "V100/T4 path. "
            "Checkpoint size is validated by tests/test_resume.py (tiny recipe within 0.05%).\n")


# (column, file, path to the median ratio): the headline ratios whose stability across runs is tracked, and the
# A/A noise floors (one contender against itself) measured in the same runs
HEADLINE = (
    ("training, measured", "train", ("ratio_vs_trainer_padded", "label_tokens_per_s", "zerotune", "median")),
    ("training, per CPU-s", "train", ("ratio_vs_trainer_padded", "label_tokens_per_cpu_s_long_run", "zerotune",
                                      "median")),
    ("data, wall", "data", ("ratio", "wall_tokens_per_s", "median")),
    ("data, per CPU-s", "data", ("ratio", "per_cpu_second", "median")),
    ("prompt", "inference", ("ratio_gguf_over_hf", "prompt_tokens_per_s", "median")),
    ("prompt, per CPU-s", "inference", ("ratio_gguf_over_hf", "prompt_tokens_per_cpu_s", "median")),
    ("decode", "inference", ("ratio_gguf_over_hf", "decode_tokens_per_s", "median")),
    ("decode, per CPU-s", "inference", ("ratio_gguf_over_hf", "decode_tokens_per_cpu_s", "median")),
    ("A/A data", "data", ("ratio", "baseline_a_a", "median")),
    ("A/A decode", "inference", ("a_a_gguf_over_gguf", "decode_tokens_per_s", "median")),
    ("A/A decode, per CPU-s", "inference", ("a_a_gguf_over_gguf", "decode_tokens_per_cpu_s", "median")),
)
# What each benchmark was asked to do: runs are comparable only when these agree (timings are not settings)
SETTINGS = {
    "train": ("seq_len", "grad_accum", "steps", "trl_steps", "warmup", "repeats", "trl_repeats", "conversations",
              "processes", "recipe_train_section", "padded_docs_per_micro_batch", "model"),
    "data": ("conversations", "seq_len", "num_proc", "repeats"),
    "inference": ("model", "prompt_tokens", "new_tokens", "repeats", "prefill_pairs_per_group", "prefill_burst",
                  "decode_pairs_per_group"),
}
HISTORY_ROWS = 6
STABLE = 0.10  # issue 9: repeated runs give ratios within 10%


def _get(doc: dict, path: tuple):
    for k in path:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def headline(results: Path) -> dict | None:
    """This run's headline ratios, keyed by a hash of the result files (so re-running the report adds nothing),
    and the hash of its settings (which runs it may be compared with)."""
    docs = {}
    for name in ("train", "data", "inference"):
        f = results / f"{name}.json"
        if not f.exists():
            return None
        docs[name] = json.loads(f.read_text())
    settings = {name: {k: (docs[name].get("setup", docs[name])).get(k) for k in keys}
                for name, keys in SETTINGS.items()}
    settings["data"]["baseline_conversations"] = _get(docs["data"], ("baseline", "conversations"))
    settings["data"]["bracketed"] = "baseline_a_a" in docs["data"]["ratio"]
    row = {"id": _hash(docs), "settings": _hash(settings), "date": str(datetime.date.today())}
    for col, name, path in HEADLINE:
        row[col] = _get(docs[name], path)
    return row


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def history(results: Path) -> str:
    """Append this run's headline ratios to history.jsonl and tabulate the last runs: the repeat-stability check.
    The spread is taken over the runs with the latest run's settings only (a run of other settings measures
    something else)."""
    hist = results / "history.jsonl"
    rows = mf.read_jsonl(hist)
    row = headline(results)
    if row and all(r["id"] != row["id"] for r in rows):
        rows.append(row)
        mf.append_jsonl(hist, row)
    rows = rows[-HISTORY_ROWS:]
    if len(rows) < 2:
        return ""
    now = rows[-1].get("settings")
    same = [r for r in rows if now and r.get("settings") == now]
    cols = [c for c, _, _ in HEADLINE]
    out = ["## Across runs (stability)", "",
           f"Median ratios of the last {len(rows)} `make bench` runs (bench/results/history.jsonl). A/A columns: one "
           "contender against itself in the same run (identical work), i.e. the noise floor; they should read "
           f"1.00x. Spread = (max - min) / median over the {len(same)} run(s) marked * (the latest run's "
           f"settings); issue 9 asks for at most {STABLE:.0%}.", "",
           "| run | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in rows:
        out.append(f"| {r['date']} {r['id'][:6]}{'*' if r in same else ''}"
                   f"{' (' + r['note'] + ')' if r.get('note') else ''} | "
                   + " | ".join("-" if r.get(c) is None else f"{r[c]:.2f}x" for c in cols) + " |")
    spread = []
    for c in cols:
        v = [r[c] for r in same if r.get(c) is not None]
        sp = ratio_stats(v)["spread"] if len(v) > 1 else None
        spread.append("-" if sp is None else f"{sp:.1%}{'' if sp <= STABLE else ' (over)'}")
    out.append("| **spread*** | " + " | ".join(spread) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    parts = [f"# `make bench` results\n\n{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}. Ratios are measured side by side in one run; absolute numbers "
             "are context only.\n"]
    for name, title in (("train", None), ("data", None), ("data_scale", None),
                        ("inference", "## Inference (SmolLM2-135M, same prompts)"), ("answers", None),
                        ("rollout", None), ("attention", None), ("sequence_parallel", None), ("zero3_host", None),
                        ("cpu_adam", None)):
        md = RESULTS / f"{name}.md"
        if not md.exists():
            parts.append(f"## {name}\n\nnot run (bench/bench_{name}.py did not write {md.name})\n")
            continue
        text = md.read_text().strip().replace("\n# ", "\n## ")
        text = "#" + text if text.startswith("# ") else (title + "\n\n" + text if title else text)
        parts.append(text + "\n")
        if (RESULTS / f"{name}.png").exists():
            parts.append(f"![{name}](results/{name}.png)\n")
    parts.append(history(RESULTS))
    if (RESULTS / "ci_runs.md").exists():  # kept by hand: make bench does not run CI
        parts.append((RESULTS / "ci_runs.md").read_text())
    parts.append(planner_validation())
    parts.append(predictions() + "\n")
    out = REPO / "bench" / "results.md"
    out.write_text("\n".join(parts))
    print(f"bench: wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
