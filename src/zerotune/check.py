"""`zerotune check RECIPE`: does the GGUF behave like the HF model, and does it fit a T4?

1. Every held-out set (`eval.sets`, or `data.heldout` scored exact) answered
   greedily by the base model, the fine-tuned HF model and the GGUF (through
   the GGUF's own chat template, stopping at its end-of-turn token), scored by
   the set's scorer (answering.score_models, whose cached answers `zerotune eval` reuses).
   Gates: the GGUF trails HF by at most `check.accuracy_margin` (or one answer
   of the set, whichever is larger: a set of n prompts cannot resolve less than
   1/n), and a set with `max_drop` (retention) keeps the fine-tuned HF score
   within that bound of the base model's. In the sets after the first, answers
   in the task's output format (leakage) score 0, are reported per model, and a
   set with `max_leakage` bounds the HF and GGUF fractions (answering.set_failures).
2. Per-token agreement on held-out text from the prepared data: mean
   KL(HF || GGUF), top-1 agreement and perplexity ratio.
3. T4 fit: weights + f16 KV cache at the recipe's context against what PyTorch reports usable (hardware.GPUS["t4"]).
   With `eval.pairs` (preference tuning): held-out pairs' preference accuracy for base, HF and GGUF
   (preference/scoring.py, eval's cache), gated like a set's score: the GGUF within the same margin of HF.
4. Prompt and decode tokens/s of the GGUF on this machine.
Writes check.json; exits 1 when a gate fails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from . import manifest as mf
from .answering import gpu_offload, leakage_by_model, load_gguf, load_rows, score_models, set_failures
from .config import Recipe
from .errors import MissingInputError, UserError
from .gguf_checks import read_header
from .hardware import GPUS, kv_bytes_per_token, llama_cpp_fit
from .layout import layout, write_resolved_recipe
from .planner.time import F
from .preference.scoring import describe as describe_pairs
from .preference.scoring import score_pairs
from .quant_types import quant_type

# A GGUF argmax that HF rates within this many nats of its own top token counts as a near-tie agreement, and
# the top-1 gate counts it as agreeing: a flip between near-tied tokens is rounding, not a broken tensor. On a
# random-init model (near-flat distributions, median top-1/top-2 margin ~0.1 nats) Q8_0 noise flips ~10% of
# argmaxes between such near-ties while mean KL stays ~2e-4. A trained model's margins are larger, but not on
# every token: SmolLM2 fine-tuned with data.replay (prose answers among the held-out documents) agreed strictly
# on 97.2% of assistant tokens at mean KL 6.5e-3, and the flips sat on near-ties (docs/smollm2_demo.md).
TIE_NATS = 0.1


def heldout_documents(r: Recipe, limit: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) of held-out documents from the prepared eval split (unpacked)."""
    from datasets import load_from_disk

    docs: list[list[int]] = []
    eval_dir = layout(r).data_eval
    if eval_dir.exists():
        for row in load_from_disk(str(eval_dir)):
            ids, pos, labels = row["input_ids"], row["position_ids"], row["labels"]
            starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
            for a, b in zip(starts, starts[1:]):
                if any(x != -100 for x in labels[a:b]):  # skip the padding pseudo-document
                    docs.append((ids[a:b], labels[a:b]))
    return docs[:limit]


def logit_agreement(llm, model_dir: Path, docs: list) -> dict:
    """HF vs GGUF per position. `docs` holds token-id lists, or (ids, labels) pairs: then top-1 agreement is
    also reported over the positions that predict a label (assistant) token, which is what the gate uses.
    Over prompt tokens a fine-tuned model's distribution can be flat by design (the tiny task's words are
    uniform draws), and top-1 there is a coin flip between near-tied tokens, not a quantization signal."""
    import torch
    from transformers import AutoModelForCausalLM

    if not getattr(llm, "_logits_all", False):
        raise ValueError("logit_agreement needs a Llama created with logits_all=True (scores of every position).")
    docs = [(d, None) if not isinstance(d, tuple) else d for d in docs]
    docs = [(ids[: llm.n_ctx()], None if lab is None else lab[: llm.n_ctx()])  # longer than the context: cut
            for ids, lab in docs if len(ids) >= 2]
    agree_lab, near_lab, n_lab = 0, 0, 0
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    kls, agree, near, margins, nll_hf, nll_gg, n = [], 0, 0, [], 0.0, 0.0, 0
    for ids, lab in docs:
        with torch.no_grad():
            hf = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        llm.reset()
        llm.eval(ids)
        gg = torch.log_softmax(torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)), -1)
        kl = (hf.exp() * (hf - gg)).sum(-1)  # KL(HF || GGUF) per position
        kls.extend(kl.tolist())
        same = hf.argmax(-1) == gg.argmax(-1)
        agree += int(same.sum())
        tied = hf.max(-1).values - hf.gather(1, gg.argmax(-1)[:, None])[:, 0] <= TIE_NATS  # includes `same`
        near += int(tied.sum())
        if lab is not None:
            predicts_label = torch.tensor([x != -100 for x in lab[1:]] + [False])
            agree_lab += int(same[predicts_label].sum())
            near_lab += int(tied[predicts_label].sum())
            n_lab += int(predicts_label.sum())
        top2 = hf.topk(2, -1).values
        margins.extend((top2[:, 0] - top2[:, 1]).tolist())
        tgt = torch.tensor(ids[1:])
        nll_hf += float(-hf[:-1].gather(1, tgt[:, None]).sum())
        nll_gg += float(-gg[:-1].gather(1, tgt[:, None]).sum())
        n += len(ids) - 1
    return {"documents": len(docs), "positions": len(kls), "mean_kl": float(np.mean(kls)) if kls else None,
            "max_kl": float(np.max(kls)) if kls else None, "top1_agreement": agree / max(1, len(kls)),
            "top1_near_tie_agreement": near / max(1, len(kls)), "tie_nats": TIE_NATS,
            "label_positions": n_lab, "top1_agreement_labels": agree_lab / n_lab if n_lab else None,
            "top1_near_tie_agreement_labels": near_lab / n_lab if n_lab else None,
            "hf_top1_margin_median": float(np.median(margins)) if margins else None,
            "ppl_hf": float(np.exp(nll_hf / max(1, n))), "ppl_gguf": float(np.exp(nll_gg / max(1, n))),
            "ppl_ratio": float(np.exp((nll_gg - nll_hf) / max(1, n)))}


def t4_fit(gguf_bytes: int, hf_config: dict, n_ctx: int) -> dict:
    heads = hf_config["num_attention_heads"]
    kv = kv_bytes_per_token(hf_config["num_hidden_layers"], hf_config.get("num_key_value_heads", heads),
                            hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    return llama_cpp_fit(GPUS["t4"], gguf_bytes, kv, n_ctx, hf_config.get("max_position_embeddings", 1 << 62))


def speed(llm, n_prompt: int = 64, n_decode: int = 32) -> dict:
    prompt = [llm.token_bos()] + [1000 + i % 5000 for i in range(n_prompt - 1)]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    tok = int(np.argmax(llm.scores[len(prompt) - 1]))
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t2 = time.perf_counter()
    return {"prompt_tokens_per_s": round(n_prompt / (t1 - t0), 1), "decode_tokens_per_s": round(n_decode / (t2 - t1), 1)}


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 3) -> float:
    """This machine's memory read rate, bytes per second: the best of `repeats` sums over a buffer far larger than
    its caches (512 MiB), one core as llama.cpp's decode reads with them all: a conservative figure."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def t4_decode(gguf_bytes: int, decode_tokens_per_s: float, on_gpu: bool, bandwidth: float | None) -> dict:
    """Decode on a T4 is memory-bound: every new token reads all the weights (the KV cache at these contexts is a
    few percent more), so its ceiling is the T4's 320 GB/s over the GGUF's bytes. Predicted: that ceiling times
    llama.cpp's efficiency measured here, decode tokens/s x bytes per token over this machine's read rate
    (read_bandwidth). On a GPU run (slurm/check_t4.sbatch: every layer offloaded) the decode measured is the T4's
    own, printed beside the ceiling."""
    ceiling = F("gpu_hbm_t4") * 1e9 / gguf_bytes
    out = {"ceiling_tokens_per_s": round(ceiling, 1), "gguf_bytes": gguf_bytes}
    if on_gpu:
        return {**out, "measured_tokens_per_s": decode_tokens_per_s,
                "of_ceiling": round(decode_tokens_per_s / ceiling, 3)}
    efficiency = decode_tokens_per_s * gguf_bytes / bandwidth
    return {**out, "predicted_tokens_per_s": round(ceiling * efficiency, 1), "efficiency_here": round(efficiency, 3),
            "read_gbs_here": round(bandwidth / 1e9, 1)}


def check(r: Recipe) -> int:
    model_dir, gguf = layout(r).model, layout(r).gguf
    for p, what in ((model_dir, "finetune"), (gguf, "quantize")):
        if not p.exists():
            raise MissingInputError(f"{p} not found. Run `make {what} RECIPE={r.name}` first.")
    read_header(gguf)  # a damaged GGUF: GGUFCheckError naming the file, before minutes of HF answers
    qtype = r.quantize.type.lower()
    gates = quant_type(qtype)  # quantize.type is validated against the table at recipe load
    max_kl, min_top1 = gates.max_kl, gates.min_top1
    max_kl = r.check.max_kl if r.check.max_kl is not None else max_kl
    min_top1 = r.check.min_top1 if r.check.min_top1 is not None else min_top1
    sets = r.eval_sets()
    if not sets:
        raise UserError(f"recipe {r.name}: check needs held-out prompts: set eval.sets (name, path, scorer) or "
                        "data.heldout.")
    rows_by_set = {es.name: load_rows(es) for es in sets}
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    print(f"check: {', '.join(f'{es.name} ({len(rows_by_set[es.name])} prompts, {es.scorer})' for es in sets)}; "
          "greedy answers from base, fine-tuned HF and GGUF", flush=True)
    scored = score_models(r, sets, rows_by_set)["sets"]
    # Whole documents of the eval split go through the GGUF: its context must hold the longest packed row.
    # ... and the speed probe its prompt and answer (speed(): 64 + 32 tokens; a short-row recipe has less)
    llm = load_gguf(gguf, n_ctx=max(r.data.seq_len, 128), n_gpu_layers=r.check.n_gpu_layers)
    try:
        agreement = logit_agreement(llm, model_dir, heldout_documents(r, r.check.n_kl_texts))
        perf = speed(llm)
        on_gpu = r.check.n_gpu_layers != 0 and gpu_offload()
    finally:
        llm.close()  # llama-cpp-python's __del__ at interpreter exit raises otherwise
    first, rows = sets[0].name, rows_by_set[sets[0].name]
    base_ans, hf_ans, gg_ans = (scored[first][m]["answers"] for m in ("base", "hf", "gguf"))
    finish = scored[first]["gguf"]["finish"]
    res = {
        "recipe": r.name, "gguf": str(gguf), "type": qtype,
        "base_accuracy": scored[first]["base"]["score"], "hf_accuracy": scored[first]["hf"]["score"],
        "gguf_accuracy": scored[first]["gguf"]["score"], "n_prompts": len(rows),
        "sets": {es.name: {"scorer": es.scorer, "n": len(rows_by_set[es.name]), "max_drop": es.max_drop,
                           **{m: scored[es.name][m]["score"] for m in ("base", "hf", "gguf")},
                           "leakage": leakage_by_model(scored[es.name]), "max_leakage": es.max_leakage} for es in sets},
        "gguf_stopped_at_end_of_turn": sum(f == "stop" for f in finish) / max(1, len(finish)),
        "hf_gguf_answer_agreement": sum(a == b for a, b in zip(hf_ans, gg_ans)) / max(1, len(rows)),
        "agreement": agreement, "gates": {"max_kl": max_kl, "min_top1": min_top1,
                                          "accuracy_margin": r.check.accuracy_margin},
        "t4": t4_fit(gguf.stat().st_size, hf_cfg, r.check.n_ctx), "speed_this_machine": perf,
        "t4_decode": t4_decode(gguf.stat().st_size, perf["decode_tokens_per_s"], on_gpu,
                               None if on_gpu else read_bandwidth()),
        "examples": [{"prompt": row["messages"][-1]["content"], "answer": row["answer"], "base": b, "hf": h, "gguf": g}
                     for row, b, h, g in list(zip(rows, base_ans, hf_ans, gg_ans))[:5]],
    }
    pairs = score_pairs(r)  # eval.pairs (preference tuning): eval's, from its cache
    res["pairs"] = pairs
    failures = []
    if pairs:  # the GGUF prefers what HF prefers, within the same margin as the sets' scores
        margin = max(r.check.accuracy_margin, 1 / pairs["n"])
        if pairs["gguf"]["accuracy"] < pairs["hf"]["accuracy"] - margin - 1e-9:
            failures.append(f"pairs: GGUF preference accuracy {pairs['gguf']['accuracy']:.3f} trails HF "
                            f"{pairs['hf']['accuracy']:.3f} by more than {margin:.3f}")
    for es in sets:
        s = res["sets"][es.name]
        margin = max(r.check.accuracy_margin, 1 / s["n"])
        if s["gguf"] < s["hf"] - margin - 1e-9:
            failures.append(f"{es.name}: GGUF score {s['gguf']:.3f} trails HF {s['hf']:.3f} by more than {margin:.3f}")
        failures += set_failures(es, s, s["leakage"])
    if agreement["mean_kl"] is not None and agreement["mean_kl"] > max_kl:
        failures.append(f"mean KL {agreement['mean_kl']:.4g} > {max_kl} for {qtype}")
    gated_top1 = agreement["top1_near_tie_agreement_labels"]  # near-ties agree (TIE_NATS)
    if gated_top1 is None:
        gated_top1 = agreement["top1_near_tie_agreement"]
    agreement["top1_gated"] = gated_top1
    if agreement["mean_kl"] is not None and gated_top1 < min_top1:
        failures.append(f"top-1 agreement on assistant tokens {gated_top1:.4f} < {min_top1} for {qtype} (a GGUF "
                        f"top token within {TIE_NATS} nats of HF's counts as agreeing)")
    res["passed"], res["failures"] = not failures, failures
    paths = layout(r)
    mf.write(paths.check_json, res)
    write_resolved_recipe(paths.check, r)
    _print_table(res)
    if failures:
        print("check: FAILED: " + "; ".join(failures), flush=True)
    summary = {k: res[k] for k in ("base_accuracy", "hf_accuracy", "gguf_accuracy")}
    summary["sets"] = {name: {m: round(s[m], 4) for m in ("base", "hf", "gguf")} for name, s in res["sets"].items()}
    leak = {name: {m: round(v, 4) for m, v in s["leakage"].items()}
            for name, s in res["sets"].items() if s["leakage"] is not None}
    if leak:  # only where measured: a recipe without a format task keeps its summary line as it was
        summary["leakage"] = leak
    if pairs:  # preference tuning: held-out preference accuracy from the starting model to the tuned one
        summary["preference"] = {"base_accuracy": pairs["base"]["accuracy"], "hf_accuracy": pairs["hf"]["accuracy"],
                                 "gguf_accuracy": pairs["gguf"]["accuracy"],
                                 "hf_reward_accuracy": pairs["hf"]["reward_accuracy"],
                                 "hf_reward_margin": round(pairs["hf"]["reward_margin"], 4)}
    summary.update(mean_kl=agreement["mean_kl"], top1_agreement=agreement["top1_gated"],
                   top1_agreement_all_positions=agreement["top1_agreement"],
                   t4_fits=res["t4"]["fits"], passed=res["passed"])
    print(json.dumps(summary), flush=True)
    return 0 if not failures else 1


def _print_table(res: dict) -> None:
    a, t, s = res["agreement"], res["t4"], res["speed_this_machine"]
    kl = f"{a['mean_kl']:.2e}" if a["mean_kl"] is not None else "n/a"
    lines = [
        f"check: {res['gguf']} ({res['type']})",
        *(line for name, s in res["sets"].items() for line in _set_lines(name, s)),
        *([describe_pairs(res["pairs"])] if res.get("pairs") else []),
        f"  GGUF stopped at its end-of-turn token on {res['gguf_stopped_at_end_of_turn']:.0%} of the first set; "
        f"answers identical to HF's on {res['hf_gguf_answer_agreement']:.0%}",
        f"  HF vs GGUF on {a['positions']} held-out positions: mean KL {kl} nats/token "
        f"(gate {res['gates']['max_kl']}), top-1 agreement {a['top1_gated']:.4f} on {a['label_positions']} assistant "
        f"positions, near-ties within {a['tie_nats']} nats agreeing (gate {res['gates']['min_top1']}; strictly "
        f"{a['top1_agreement_labels'] if a['top1_agreement_labels'] is not None else a['top1_agreement']:.4f}, "
        f"{a['top1_agreement']:.4f} over all positions), "
        f"perplexity ratio {a['ppl_ratio']:.4f}",
        f"  T4: {t['weights_gib']} GiB weights + KV cache at {t['n_ctx']} tokens = {t['needed_gib']} GiB of "
        f"{t['usable_gib']} -> {'fits' if t['fits'] else 'DOES NOT FIT'}; largest context that fits {t['max_context_that_fits']:,}",
        f"  this machine: prompt {s['prompt_tokens_per_s']} tok/s, decode {s['decode_tokens_per_s']} tok/s",
        _t4_decode_line(res["t4_decode"]),
    ]
    print("\n".join(lines), flush=True)


def _t4_decode_line(d: dict) -> str:
    gb = d["gguf_bytes"] / 1e9
    if "measured_tokens_per_s" in d:
        return (f"  T4 decode: measured {d['measured_tokens_per_s']} tok/s on this GPU; ceiling 320 GB/s / {gb:.2f} GB "
                f"per token = {d['ceiling_tokens_per_s']} ({d['of_ceiling']:.0%} of it)")
    return (f"  T4 decode: predicted ~{d['predicted_tokens_per_s']} tok/s = 320 GB/s / {gb:.2f} GB per token "
            f"({d['ceiling_tokens_per_s']} ceiling) x llama.cpp's efficiency here {d['efficiency_here']:.2f} (its decode "
            f"x {gb:.2f} GB over this machine's {d['read_gbs_here']} GB/s read rate); slurm/check_t4.sbatch measures it")


def _set_lines(name: str, s: dict) -> list[str]:
    """A set's scores, and under them its leakage when measured."""
    lines = [f"  {name} ({s['n']} prompts, {s['scorer']}): base {s['base']:.3f} | HF {s['hf']:.3f} | GGUF {s['gguf']:.3f}"
             + (f" (max drop from base {s['max_drop']})" if s["max_drop"] is not None else "")]
    if s["leakage"] is not None:
        lk = s["leakage"]
        lines.append(f"    answers in the task's format (leakage, scored 0): base {lk['base']:.3f} | HF {lk['hf']:.3f} | "
                     f"GGUF {lk['gguf']:.3f}" + (f" (max {s['max_leakage']})" if s["max_leakage"] is not None else ""))
    return lines
