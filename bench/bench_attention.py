"""Per-document attention (sdpa_docs) vs SDPA with transformers' dense block-causal mask, training a real model.

    .venv/bin/python bench/bench_attention.py [--seq 4096 8192 16384] [--repeats 2] [--out PATH]

SmolLM2-135M-Instruct (fp32, gradient checkpointing, one process on this machine's threads) takes training steps
(forward + backward + AdamW) on the same packed row under `sdpa` (the dense (1, 1, S, S) mask every peer uses without
FlashAttention 2) and under zerotune's `sdpa_docs` (attention.py: SDPA's causal kernel once per document). The row
is packed by zerotune's own best-fit-decreasing from chats drawn from bench_data.py's length distribution (log-normal
turns, 1-6 exchanges, 40% with a system prompt) and tokenized with SmolLM2's chat template. The two take turns in
every repeat (who goes first alternates), the models loaded once and warmed up; both start from the same weights and
must give the same first loss (the benchmark fails otherwise). Attention's share of the executed FLOPs is stated for
each kernel at each length. Reported per wall-second and per CPU-second. Writes bench/results/attention.json and .md.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_env import RESULTS, SMOLLM2  # first: the hub offline, src/ on the path

from bench_stats import Steal, fmt_ratio, ratio_stats, write_results  # noqa: E402

MODEL = SMOLLM2
KERNELS = ("sdpa", "sdpa_docs")


def chat_lengths_and_ids(tok, n: int, seed: int) -> list[list[int]]:
    """n chats of bench_data.py's distribution, templated and tokenized as `make data` would."""
    from bench_data import generate

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "chats.jsonl"
        generate(path, n, seed=seed)
        return [list(tok.apply_chat_template(json.loads(line)["messages"], tokenize=True)["input_ids"])
                for line in path.read_text().splitlines()]


def packed_row(docs: list[list[int]], seq: int, pad_id: int) -> tuple[dict, list[int], float]:
    """A typical row of what `make data` packs from `docs` (best-fit-decreasing; documents longer than seq truncated,
    as data.overlong: truncate does): among the rows at least 95% full, the one whose attention span is nearest the
    whole set's (BFD's first rows hold the longest documents, its last the leftovers: neither is typical). Returns
    the row as tensors, its document lengths and the whole set's span."""
    import numpy as np
    import torch

    from zerotune.data.packing import best_fit_decreasing, packed_row as make_row

    docs = [d[:seq] for d in docs]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    bins = best_fit_decreasing(lengths, seq)

    def span(b):
        used = int(lengths[b].sum())
        return (int((lengths[b] ** 2).sum()) + (seq - used) ** 2) / seq

    overall = sum(span(b) for b in bins) / len(bins)
    full = [b for b in bins if lengths[b].sum() >= 0.95 * seq] or bins
    best = min(full, key=lambda b: abs(span(b) - overall))
    row, _ = make_row(((docs[i], docs[i]) for i in sorted(best)), seq, pad_id)
    lengths = [len(docs[i]) for i in sorted(best)]
    ids = torch.tensor(np.asarray(row["input_ids"]), dtype=torch.long)[None]
    pos = torch.tensor(np.asarray(row["position_ids"]), dtype=torch.long)[None]
    return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}, lengths, overall


def flops_per_token(cfg, n_params: int, seq: int, span: float) -> dict:
    """Executed FLOPs per token of a training step with gradient checkpointing: 6N + 2N recompute, attention x4
    (forward, recompute, backward 2x): dense mask 4 S q_dim per layer forward, per document 2 x span x q_dim."""
    q_dim = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    base = 8 * n_params
    attn = {"sdpa": 4 * 4 * seq * q_dim * cfg.num_hidden_layers,
            "sdpa_docs": 4 * 2 * span * q_dim * cfg.num_hidden_layers}
    return {k: {"total": base + a, "attention_share": a / (base + a)} for k, a in attn.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=2, help="repeats at 8K rows; 4K gets twice as many, 16K half "
                    "(at least 1): a dense 16K step takes ~25 minutes here")
    ap.add_argument("--chats", type=int, default=3000, help="chats drawn to pack rows from")
    ap.add_argument("--out", type=Path, default=RESULTS / "attention", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerotune.attention import load_name
    from zerotune.data.packing import attention_pairs
    from zerotune.quiet import silence_known_noise

    silence_known_noise()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    docs = chat_lengths_and_ids(tok, a.chats, seed=0)
    models, opts = {}, {}
    for k in KERNELS:
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32, attn_implementation=load_name(k))
        m.config.use_cache = False
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        models[k], opts[k] = m.train(), torch.optim.AdamW(m.parameters(), lr=1e-6)
    n_params = sum(p.numel() for p in models["sdpa"].parameters())

    def step(k: str, batch: dict) -> tuple[float, float, float]:
        w, c = time.perf_counter(), time.process_time()
        loss = models[k](**batch).loss
        loss.backward()
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)
        return loss.item(), time.perf_counter() - w, time.process_time() - c

    # warm-up: a process's first steps pay for lazy initialisation; a short row, so that it costs little
    warm, _, _ = packed_row(docs, 1024, tok.pad_token_id)
    for k in KERNELS:
        step(k, warm)
    steal = Steal()
    results = []
    for seq in a.seq:
        batch, lengths, overall = packed_row(docs, seq, tok.pad_token_id)
        span = attention_pairs(batch["position_ids"][0].numpy()) / seq
        times = {k: {"wall": [], "cpu": []} for k in KERNELS}
        first = {}
        for rep in range(max(1, a.repeats * 8192 // seq)):
            for k in (KERNELS if rep % 2 == 0 else KERNELS[::-1]):
                loss, wall, cpu = step(k, batch)
                first.setdefault(k, loss)
                times[k]["wall"].append(wall)
                times[k]["cpu"].append(cpu)
                print(f"bench_attention: seq {seq:,} {k:9s} repeat {rep + 1}: {wall:7.1f} s wall, {cpu:7.1f} s CPU, "
                      f"{seq / wall:6.0f} tokens/s", flush=True)
        # both models took the same steps on the same rows: the same weights must give the same loss
        if abs(first["sdpa"] - first["sdpa_docs"]) > 1e-4 * abs(first["sdpa"]):
            raise SystemExit(f"seq {seq}: losses differ, sdpa {first['sdpa']:.6f} vs sdpa_docs {first['sdpa_docs']:.6f}")
        wall = ratio_stats([d / p for d, p in zip(times["sdpa"]["wall"], times["sdpa_docs"]["wall"])])
        cpu = ratio_stats([d / p for d, p in zip(times["sdpa"]["cpu"], times["sdpa_docs"]["cpu"])])
        fl = flops_per_token(models["sdpa"].config, n_params, seq, span)
        results.append({"seq": seq, "documents": len(lengths), "doc_p50": sorted(lengths)[len(lengths) // 2],
                        "doc_max": max(lengths), "padding": seq - sum(lengths), "attention_span": round(span, 1),
                        "data_attention_span": round(overall, 1),
                        "first_loss": first, "times": times, "speedup_wall": wall, "speedup_cpu": cpu,
                        "tokens_per_s": {k: round(seq / min(times[k]["wall"]), 1) for k in KERNELS},
                        "attention_flop_share": {k: round(v["attention_share"], 3) for k, v in fl.items()},
                        "flops_ratio": round(fl["sdpa"]["total"] / fl["sdpa_docs"]["total"], 2)})
    out = {"model": "SmolLM2-135M-Instruct", "params": n_params, "threads": torch.get_num_threads(),
           "repeats": a.repeats, "steal": steal.fraction(), "rows": results}
    lines = ["# Per-document attention vs the dense block-causal mask (SmolLM2-135M training)", "",
             f"One packed row per length, chats of bench_data.py's distribution, SmolLM2's template; fp32, gradient "
             f"checkpointing, AdamW, {out['threads']} threads; `sdpa` (dense mask) vs `sdpa_docs` (SDPA per document), "
             f"alternating after a warm-up ({a.repeats} repeats at 8K, twice as many at 4K, half at 16K); the row is the one "
             f"whose attention span is nearest the packed set's; identical first losses. CPU steal {out['steal']}.", "",
             "| row | documents (p50 / max) | attention span (row / set) | attention share of FLOPs: dense / per document | "
             "FLOPs ratio | tokens/s dense / per document | speed-up per wall-second | per CPU-second |",
             "|---|---|---:|---|---:|---|---|---|"]
    for r in results:
        sh = r["attention_flop_share"]
        lines.append(f"| {r['seq']:,} | {r['documents']} ({r['doc_p50']} / {r['doc_max']}) | {r['attention_span']:.0f} / "
                     f"{r['data_attention_span']:.0f} | "
                     f"{sh['sdpa']:.0%} / {sh['sdpa_docs']:.0%} | {r['flops_ratio']:.2f}x | "
                     f"{r['tokens_per_s']['sdpa']:.0f} / {r['tokens_per_s']['sdpa_docs']:.0f} | "
                     f"{fmt_ratio(r['speedup_wall'])} | {fmt_ratio(r['speedup_cpu'])} |")
    lines += ["", "Attention span: sum of d^2 / sum of d over the row's documents (padding tail included), the mean "
              "number of tokens each token attends over per document; the dense mask makes every token pay for S."]
    write_results(a.out, out, lines, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
