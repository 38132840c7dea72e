"""The training benchmark's numbers and report: per-run summaries, medians and ratios over repeats, the
fraction of the matmul limit, the same-job A/B summary, train.md and train.png."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench_stats import pct, ratio_stats
from train_setup import CONFIGS, LABELS, procs

# The three estimates of useful-token throughput whose ratios to the padded Trainer are reported
METRICS = {"label_tokens_per_s": "measured", "label_tokens_per_s_long_run": "long-run",
           "label_tokens_per_cpu_s_long_run": "long-run, per CPU-s"}
MEDIAN_KEYS = ("label_tokens_per_s", "label_tokens_per_s_long_run", "label_tokens_per_cpu_s_long_run",
               "model_flops_per_s", "of_matmul_limit", "of_matmul_limit_cpu_s",
               "real_tokens_per_s", "processed_tokens_per_s", "cpu_utilisation", "efficiency", "efficiency_long_run",
               "peak_mem_gib", "label_tokens_per_step", "real_tokens_per_step", "wall_s", "startup_and_teardown_s")


def summarise(run: dict, warmup: int, long_run_eff: float, label_fraction: float) -> dict:
    rows = run["rows"]
    m = [r for r in rows if r["step"] > warmup]
    t, cpu = sum(r["step_time_s"] for r in m), sum(r["cpu_s"] for r in m)
    tot = {k: sum(r[k] for r in m) for k in ("label_tokens", "real_tokens", "processed_tokens")}
    return {"measured_steps": len(m), "measured_s": round(t, 2), "measured_cpu_s": round(cpu, 2),
            "wall_s": round(run["wall_s"], 1),
            "startup_and_teardown_s": round(run["wall_s"] - sum(r["step_time_s"] for r in rows), 1),
            "label_tokens_per_s": tot["label_tokens"] / t, "real_tokens_per_s": tot["real_tokens"] / t,
            "processed_tokens_per_s": tot["processed_tokens"] / t,
            # the measured cost per processed token, applied to the whole data set's efficiency and label fraction
            "label_tokens_per_s_long_run": tot["processed_tokens"] / t * long_run_eff * label_fraction,
            "label_tokens_per_cpu_s_long_run": tot["processed_tokens"] / cpu * long_run_eff * label_fraction,
            "cpu_utilisation": cpu / t,  # CPU-seconds of all ranks per second: 2.0 = both cores busy throughout
            "efficiency": tot["real_tokens"] / tot["processed_tokens"], "efficiency_long_run": long_run_eff,
            "label_tokens_per_step": tot["label_tokens"] / len(m), "real_tokens_per_step": tot["real_tokens"] / len(m),
            "peak_mem_gib": max(r["peak_mem_gib_max_rank"] for r in rows), "steps": rows}


def of_matmul_limit(m: dict, flops_tok: float, limits: dict) -> dict:
    """Model FLOPs/s (6N + attention per processed token, padding included: what the contender computes) over
    the fp32 matmul rate of all cores at the model's shapes, per wall- and per CPU-second. With gradient
    checkpointing the forward runs twice: hardware FLOPs are 8N, i.e. x(8/6) on the dense part."""
    flops_s = m["processed_tokens_per_s"] * flops_tok
    flops_cpu_s = m["processed_tokens_per_s"] * flops_tok / m["cpu_utilisation"]
    mm = limits["matmul_all_cores"]
    return {"model_flops_per_s": flops_s, "of_matmul_limit": flops_s / mm["flops_per_s"],
            # per CPU-second of the ranks vs per CPU-second of the microbenchmark: load-independent
            "of_matmul_limit_cpu_s": flops_cpu_s / mm["flops_per_cpu_s"]}


def ab_summary(raw: dict, long_eff: dict) -> dict:
    res = {}
    for shape, rows in raw.items():
        res[shape] = {"steps": len(rows),
                      "ms_per_processed_token_wall": statistics.median(1e3 * r["step_time_s"] / r["processed_tokens"]
                                                                      for r in rows),
                      "ms_per_processed_token_cpu": statistics.median(1e3 * r["cpu_s"] / r["processed_tokens"]
                                                                     for r in rows),
                      "rows": rows}
    p, q = res["packed"], res["padded"]
    scale = long_eff["zerotune"] / long_eff["trainer_padded"]
    res["implied_label_token_ratio_wall"] = scale * q["ms_per_processed_token_wall"] / p["ms_per_processed_token_wall"]
    res["implied_label_token_ratio_cpu"] = scale * q["ms_per_processed_token_cpu"] / p["ms_per_processed_token_cpu"]
    return res


def aggregate(repeats: list[dict], configs: list[str]) -> tuple[dict, dict]:
    """Medians over repeats per config, and each config's ratio to the padded Trainer within each repeat."""
    median = {c: {k: statistics.median(r[c][k] for r in repeats if c in r) for k in MEDIAN_KEYS} for c in configs}
    ratios = {}
    if "trainer_padded" in configs:
        for key in METRICS:
            ratios[key] = {c: ratio_stats([r[c][key] / r["trainer_padded"][key] for r in repeats if c in r])
                           for c in configs if c != "trainer_padded"}
    return median, ratios


def notes(label_check: dict | None, b: int, seq_len: int, pack_eff: float, mean_doc: float, pad_eff: dict) -> list[str]:
    return [
        "Label tokens = tokens with a loss (assistant turns incl. their end-of-turn token); identical token ids and "
        "labels for zerotune, the Trainer baseline (bench_data.baseline) and TRL with assistant_only_loss=True "
        f"({label_check['identical_ids_and_labels'] if label_check else 'n/a'}/"
        f"{label_check['conversations'] if label_check else 'n/a'} conversations checked for TRL, which trains "
        f"SmolLM2 through bench/recipes/chatml_training.jinja: TRL ships no training template for its ChatML).",
        f"Padded micro-batch = {b} documents per rank ({seq_len} x packing efficiency {pack_eff} / mean document "
        f"{mean_doc:.0f} tokens). Expected padding efficiency of random micro-batches on this data: "
        + ", ".join(f"{k} docs {pad_eff[k]:.2f}" for k in (1, 2, 4, 8)) + ".",
        "Every contender's TrainingArguments come from zerotune.train.args.training_kwargs(the bench recipe): the same "
        "optimizer, schedule, precision, DeepSpeed config and gradient checkpointing setting (off in the bench "
        "recipe); LoRA uses the recipe's peft defaults (r 16 on every linear layer of the blocks).",
        "Model FLOPs = 6N + attention per processed token (zerotune.metrics.flops_per_token; LoRA is counted the "
        "same, although it skips the frozen weights' gradients). The limit is the fp32 matmul rate of both cores "
        "at the model's shapes, measured by bench/bench_limits.py in this run. The bench recipe trains without "
        "gradient checkpointing (bench/README.md: it cost 11-15% CPU per label token); with it, the recompute adds "
        "2N per token that the fraction would not count.",
        "Peak memory is the max RSS of a worker process (ru_maxrss) over ranks, so it includes the Python, "
        "torch and DeepSpeed baseline of each process (~0.8 GiB here) besides the model, activations and logits.",
    ]


def plot(res: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c for c in CONFIGS if c in res["median"]]
    colors = ["#228833" if c == "zerotune" else "#4477aa" if c == "trainer_padded" else "#ccbb44" for c in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = list(range(len(names)))
    w = 0.4
    a.bar([i - w / 2 for i in x], [res["median"][c]["label_tokens_per_s"] for c in names], w, color=colors,
          label="measured steps")
    a.bar([i + w / 2 for i in x], [res["median"][c]["label_tokens_per_s_long_run"] for c in names], w,
          color=colors, alpha=0.5, hatch="//", label="long-run estimate")
    for i, c in enumerate(names):
        mine = [r[c] for r in res["repeats"] if c in r]
        a.scatter([i - w / 2] * len(mine), [m["label_tokens_per_s"] for m in mine],
                  color="k", s=10, zorder=3)
        a.scatter([i + w / 2] * len(mine), [m["label_tokens_per_s_long_run"] for m in mine],
                  color="k", s=10, zorder=3)
    a.set_ylabel("label tokens / s (2 CPU ranks)")
    a.set_title("Useful-token throughput (median; dots = repeats)", fontsize=10)
    a.legend(fontsize=8)
    b.bar(x, [res["median"][c]["peak_mem_gib"] for c in names], color=colors)
    b.set_ylabel("peak RSS, max over ranks (GiB)")
    b.set_title("Peak memory", fontsize=10)
    for ax in (a, b):
        ax.set_xticks(x, [LABELS[c].replace(", ", ",\n") for c in names], fontsize=8)
    st = res["setup"]
    fig.suptitle(f"{st['model']}, seq_len {st['seq_len']}, DeepSpeed ZeRO-3 on {procs()} CPU processes, "
                 f"{st['repeats']} alternating repeats", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def markdown(res: dict) -> str:
    s, med, rat = res["setup"], res["median"], res["ratio_vs_trainer_padded"]
    lines = [
        "# Training-throughput benchmark (`bench/bench_train.py`)",
        "",
        f"{s['model_description']}, "
        f"{s['conversations']:,} synthetic multi-turn chats (bench_data.generate; mean {s['mean_doc_tokens']:.0f} "
        f"tokens after truncation to seq_len {s['seq_len']}, {s['label_fraction']:.1%} of them label tokens), "
        f"DeepSpeed ZeRO-3 on {procs()} CPU processes, fp32, gradient accumulation {s['grad_accum']}, "
        f"{s['steps']} optimizer steps per run ({s['trl_steps']} for TRL) of which the first {s['warmup']} not "
        f"measured, {s['repeats']} "
        f"alternating repeats (LoRA and TRL in the first {s.get('trl_repeats', s['repeats'])}), {res['machine']['cpus']} CPUs shared with other jobs (ratios within a repeat are what "
        f"count). Whole benchmark: {res['wall_s'] / 60:.1f} min. Medians over repeats:",
        "",
        "| config | label tokens/s, measured | label tokens/s, long-run | label tokens per CPU-s, long-run | "
        "total tokens processed/s | padding/packing efficiency, measured (data set) | peak memory (GiB) | "
        "ratio vs padded Trainer: measured / long-run / per CPU-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in CONFIGS:
        if c not in med:
            continue
        m = med[c]
        r = [rat.get(k, {}).get(c, {}).get("median", 1.0) for k in METRICS]
        lines.append(f"| {LABELS[c]} | {m['label_tokens_per_s']:,.0f} | {m['label_tokens_per_s_long_run']:,.0f} | "
                     f"{m['label_tokens_per_cpu_s_long_run']:,.0f} | {m['processed_tokens_per_s']:,.0f} | "
                     f"{m['efficiency']:.3f} ({m['efficiency_long_run']:.3f}) | {m['peak_mem_gib']:.2f} | "
                     + " / ".join(f"{x:.2f}x" for x in r) + " |")
    lines += ["", "- *measured*: label tokens counted in the measured steps / their wall time.",
              "- *long-run*: the measured processed tokens/s x the padding/packing efficiency on the whole data set x "
              "its label fraction. The measured steps see only a few dozen documents, whose label fraction and "
              "padding vary a lot; the cost per processed token does not. With identical labels for every contender, "
              "this is the label-token rate of a long run without that sample noise.",
              "- *per CPU-s*: the same with the CPU time of the worker processes (user + system, both ranks) instead "
              "of wall time: insensitive to other jobs taking the cores. On an idle machine it is the wall rate / "
              f"{procs()}.",
              "", "Ratio to the padded Trainer in each repeat (spread = (max - min) / median):", "",
              "| config | metric | " + " | ".join(f"repeat {i + 1}" for i in range(s["repeats"])) + " | spread |",
              "|---|---|" + "---:|" * (s["repeats"] + 1)]
    for key, name in METRICS.items():
        for c, r in rat.get(key, {}).items():
            cells = r["per_repeat"] + [None] * (s["repeats"] - len(r["per_repeat"]))
            lines.append(f"| {LABELS[c]} | {name} | " + " | ".join("-" if x is None else f"{x:.2f}x" for x in cells) +
                         (f" | {r['spread']:.1%} |" if len(r["per_repeat"]) > 1 else " | - |"))
    lines += ["", "CPU-seconds the job got per wall second (2.00 = both cores throughout; less = other jobs took them): "
              + "; ".join(f"{LABELS[c]} " + ", ".join(f"{r[c]['cpu_utilisation']:.2f}" for r in res["repeats"] if c in r)
                          for c in CONFIGS if c in med) + ".",
              "", "CPU steal during each run (share of the vCPUs' time the hypervisor gave to other guests, "
              "from /proc/stat; it slows a run without showing in its CPU time): "
              + "; ".join(f"{LABELS[c]} " + ", ".join(pct(r[c].get("steal")) for r in res["repeats"] if c in r)
                          for c in CONFIGS if c in med) + "."]
    ab = res.get("same_job_ab")
    if ab:
        p, q = ab["packed"], ab["padded"]
        lines += ["", f"Same-job A/B (a diagnostic, not the CLI): one DeepSpeed ZeRO-3 job on the same 2 processes "
                      f"whose optimizer steps alternate between zerotune's packed rows and the padded Trainer's "
                      f"{s['padded_docs_per_micro_batch']}-document micro-batches ({p['steps']} + {q['steps']} measured "
                      f"steps), so that load from other jobs hits both alike. Median per step, ms per processed token: "
                      f"packed {p['ms_per_processed_token_wall']:.2f} wall / {p['ms_per_processed_token_cpu']:.2f} CPU, "
                      f"padded {q['ms_per_processed_token_wall']:.2f} wall / {q['ms_per_processed_token_cpu']:.2f} CPU "
                      f"(padded wall time also includes the rank that waits for the one with the longer batch). "
                      f"With the data set's efficiencies ({s['efficiency_long_run']['zerotune']:.3f} packed, "
                      f"{s['efficiency_long_run']['trainer_padded']:.3f} padded) that implies a useful-token ratio of "
                      f"**{ab['implied_label_token_ratio_wall']:.2f}x** (wall) / "
                      f"{ab['implied_label_token_ratio_cpu']:.2f}x (CPU) for zerotune's batches over the padded ones."]
    lim = res["limits"]["matmul_all_cores"]
    lines += ["", f"Against this machine's limit, measured in the same run: fp32 matmul at the model's shapes, "
                  f"{lim['processes']} single-thread processes at once: {lim['flops_per_s'] / 1e9:.1f} GFLOP/s "
                  f"({lim['flops_per_cpu_s'] / 1e9:.1f} GFLOP per CPU-second of one process). Model FLOPs per "
                  f"processed token: {res['flops_per_token'] / 1e6:.0f} M.", "",
              "| config | model GFLOP/s | of the matmul limit (wall) | of the matmul limit (per CPU-s) |",
              "|---|---:|---:|---:|"]
    lines += [f"| {LABELS[c]} | {med[c]['model_flops_per_s'] / 1e9:.1f} | {med[c]['of_matmul_limit']:.0%} | "
              f"{med[c]['of_matmul_limit_cpu_s']:.0%} |" for c in CONFIGS if c in med]
    goals = []
    z = rat.get("label_tokens_per_cpu_s_long_run", {}).get("zerotune")
    if z:
        goals.append(f"zerotune >= 1.5x the padded Trainer per CPU-second: {z['median']:.2f}x "
                     f"({'met' if z['median'] >= 1.5 else 'NOT met'})")
    if "trl_packing" in med and "zerotune" in med:
        k = "label_tokens_per_cpu_s_long_run"
        both = [r["zerotune"][k] / r["trl_packing"][k] for r in res["repeats"] if "trl_packing" in r]
        x = statistics.median(both)
        goals.append(f"zerotune >= 1.0x TRL with packing per CPU-second: {x:.2f}x ({'met' if x >= 1.0 else 'NOT met'})")
    if "zerotune" in med:
        f = med["zerotune"]["of_matmul_limit_cpu_s"]
        goals.append(f"training at >= 50% of the measured matmul rate (per CPU-second): {f:.0%} "
                     f"({'met' if f >= 0.5 else 'NOT met'})")
    if goals:
        lines += ["", "Issue 21 goals: " + "; ".join(goals) + "."]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"



def write(res: dict, out: Path) -> str:
    """train.json, train.png and train.md beside each other; returns the markdown."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    return md
