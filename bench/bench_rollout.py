"""GRPO rollouts on CPU: zerotune's left-padded generate() against transformers' continuous batching.

    .venv/bin/python bench/bench_rollout.py [--prompts 2,8] [--group 8] [--new-tokens 48] [--repeats 3]
                                            [--seed 0] [--out PATH]

A rollout samples G completions per prompt (do_sample, temperature 1.0, top_p 1.0, no top_k). SmolLM2-135M-Instruct
samples them for the first N prompts of data/smollm2/heldout.jsonl (one size per --prompts entry: N x G sequences,
2 x 8 = 16 and 8 x 8 = 64 by default), up to --new-tokens each, two ways:

- hf_generate: zerotune's answering path (zerotune.answering.hf_answers): each prompt tokenized alone through the
  chat template, left-padded, one model.generate(..., num_return_sequences=G, use_cache=True) call for all N x G
  sequences, stopping at the chat template's stop ids (zerotune.chat_template.stop_ids); seeded with
  torch.manual_seed (generate() takes no generator: it samples from torch's global RNG).
- generate_batch: transformers' continuous batching, model.generate_batch(prompt ids, GenerationConfig(...,
  num_return_sequences=G)), seeded through ContinuousBatchingConfig(seed=...), with a paged KV cache sized for the
  workload (num_blocks, max_batch_tokens): its default sizing on CPU claims 60% of the machine's total RAM
  (psutil's total less this process's RSS, whatever else is running) and got this process OOM-killed on a 23 GiB VM.
  warmup=False: its warm-up pre-captures CUDA graphs, of no use on CPU (none are used there).

Generated tokens are counted up to and including the first stop id (all of --new-tokens when none comes). Both paths
run in one process, the model loaded once; each path is warmed up once (its first call pays lazy initialisation),
then the two take turns, same seed every time (a, b, a, b, ...; who goes first alternates per repeat). Reported per
wall-second and per CPU-second (process time: every thread, the continuous-batching worker included); the ratio
generate_batch / hf_generate is taken within each repeat, then its median. Each path's samples are also compared
across the repeats (same seed: are they reproduced?). Writes bench/results/rollout.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_env import REPO, RESULTS, SMOLLM2  # first: the hub offline, src/ on the path

from bench_stats import Steal, fmt_ratio, ratio_stats, timed, write_results  # noqa: E402

MODEL = SMOLLM2
PROMPTS = REPO / "data" / "smollm2" / "heldout.jsonl"
PATHS = {"hf_generate": "zerotune's left-padded generate()", "generate_batch": "transformers generate_batch (CB)"}


def count(new: list[int], stop: list[int]) -> tuple[list[int], bool]:
    """The real tokens of one completion: up to and including the first stop id (generate() pads a row that
    stopped early with a stop id), and whether it stopped."""
    end = next((k + 1 for k, t in enumerate(new) if t in stop), None)
    return (new[:end], True) if end is not None else (new, False)


def hf_rollout(model, stop: list[int], prompts: list[list[int]], group: int, new_tokens: int, seed: int,
               pad: int) -> list[list[int]]:
    """hf_answers' batch, sampling: left-padded to the longest prompt, G rows per prompt (generate() repeats each
    prompt G times, consecutively), every sequence in one generate() call."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=group,
                             eos_token_id=stop, pad_token_id=stop[0], use_cache=True)
    return [count(row, stop)[0] for row in gen[:, width:].tolist()]


def cb_config(n_seqs: int, longest: int, new_tokens: int, seed: int):
    from transformers import ContinuousBatchingConfig

    page = 256
    blocks = n_seqs * -(-(longest + new_tokens) // page)  # every sequence's own pages (no reliance on sharing)
    return ContinuousBatchingConfig(seed=seed, page_size=page, num_blocks=blocks + 4, max_batch_tokens=1024)


def cb_rollout(model, stop: list[int], prompts: list[list[int]], group: int, new_tokens: int,
               seed: int) -> list[list[int]]:
    """generate_batch with num_return_sequences=G: results come back per prompt, its G - 1 forked children then
    the parent (generate_batch's own order)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                          num_return_sequences=group, eos_token_id=stop, pad_token_id=stop[0])
    out = model.generate_batch(prompts, generation_config=gc, warmup=False, progress_bar=False,
                               continuous_batching_config=cb_config(len(prompts) * group,
                                                                    max(len(p) for p in prompts), new_tokens, seed))
    failed = [k for k, r in out.items() if r.error is not None]
    if len(out) != len(prompts) * group or failed:
        raise SystemExit(f"bench rollout: generate_batch returned {len(out)} of {len(prompts) * group} sequences"
                         + (f", failed: {failed[:3]}: {out[failed[0]].error}" if failed else ""))
    return [count(list(r.generated_tokens), stop)[0] for r in out.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="2,8", help="comma-separated prompt counts, one measured size each")
    ap.add_argument("--group", type=int, default=8, help="G: sampled completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    # one thread, as bench_inference.py gives HF: with two OpenMP threads on this 2-core VM, another process on a
    # core left one thread spinning at every barrier (a 16-sequence call went from 15 s to 122 s, CPU time alike)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "rollout", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    import torch

    from zerotune.answering import load_hf
    from zerotune.quiet import silence_known_noise

    silence_known_noise()
    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.prompts.split(",")]
    model, tok, stop = load_hf(MODEL)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad = stop[0] if pad is None else pad
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines()[:max(sizes)]]
    # each prompt tokenized alone, as hf_answers does; the same ids go to both paths
    prompts = [list(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for r in rows]
    fns = {"hf_generate": lambda ps: hf_rollout(model, stop, ps, a.group, a.new_tokens, a.seed, pad),
           "generate_batch": lambda ps: cb_rollout(model, stop, ps, a.group, a.new_tokens, a.seed)}
    # warm-up, one call each: the first generate() of a process pays for lazy initialisation
    for name, fn in fns.items():
        _, wall, _, _ = timed(lambda: fn(prompts[:min(sizes)]))
        print(f"bench rollout: warm-up {name:<14} {wall:6.1f} s", flush=True)
    steal = Steal()
    res_sizes = []
    for n in sizes:
        ps = prompts[:n]
        runs = {name: [] for name in fns}
        samples = {name: [] for name in fns}
        for rep in range(a.repeats):
            for name in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
                out, wall, cpu, sys_s = timed(lambda: fns[name](ps))
                toks = sum(len(s) for s in out)
                runs[name].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "sys_s": round(sys_s, 2),
                                   "tokens": toks, "tokens_per_s": round(toks / wall, 1), "tokens_per_cpu_s": round(toks / cpu, 1)})
                samples[name].append(out)
                print(f"bench rollout: {n * a.group:3d} seqs, repeat {rep + 1}/{a.repeats} {name:<14} "
                      f"{wall:6.1f} s wall {cpu:6.1f} s CPU ({sys_s:4.1f} system) {toks:5d} tokens", flush=True)
        per = {}
        for name, rs in runs.items():
            first = samples[name][0]
            per[name] = {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "sys_s",
                                                                            "tokens", "tokens_per_s",
                                                                            "tokens_per_cpu_s")}
            per[name]["cpu_per_wall"] = round(per[name]["cpu_s"] / per[name]["wall_s"], 2)
            per[name]["reproduced_across_repeats"] = all(s == first for s in samples[name][1:])
            per[name]["stopped"] = sum(bool(s) and s[-1] in stop for s in first)
            per[name]["distinct_per_prompt"] = statistics.mean(
                len({tuple(s) for s in first[i * a.group:(i + 1) * a.group]}) for i in range(n))
        ratio = {clock: ratio_stats([b[clock] / h[clock] for h, b in zip(runs["hf_generate"],
                                                                         runs["generate_batch"])])
                 for clock in ("tokens_per_s", "tokens_per_cpu_s")}
        res_sizes.append({"prompts": n, "sequences": n * a.group, "runs": runs, "median": per,
                          "same_samples_both_paths": samples["hf_generate"][0] == samples["generate_batch"][0],
                          "ratio_generate_batch_over_hf_generate": ratio})
    res = {"setup": {"model": "SmolLM2-135M-Instruct (fp32, CPU, sdpa)", "prompts_file": str(PROMPTS.relative_to(REPO)),
                     "sizes": sizes, "group": a.group, "new_tokens": a.new_tokens, "repeats": a.repeats,
                     "seed": a.seed, "threads": torch.get_num_threads(),
                     "attn_implementation": model.config._attn_implementation, "stop_ids": stop,
                     "sampling": {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
                     "generate_batch_config": {k: getattr(cb_config(sizes[-1] * a.group, 0, a.new_tokens, a.seed), k)
                                               for k in ("page_size", "max_batch_tokens")}},
           "sizes": res_sizes, "steal": steal.fraction()}
    md = ["# GRPO rollouts (SmolLM2-135M, G samples per prompt)", "",
          f"The first prompts of {res['setup']['prompts_file']}, G = {a.group} sampled completions each "
          f"(temperature 1.0, top_p 1.0, no top_k, seed {a.seed}), up to {a.new_tokens} new tokens, all sequences "
          f"at once: zerotune's left-padded generate() (hf_answers' batches, num_return_sequences=G, KV cache) "
          f"against transformers' continuous batching (generate_batch, paged cache sized for the workload, sdpa). "
          f"Tokens: generated up to and including the first stop id. Medians of {a.repeats} interleaved repeats after "
          f"a warm-up each; {res['setup']['threads']} threads; CPU steal {res['steal']}.", "",
          "| sequences | path | wall s | CPU s | CPU/wall | tokens | tokens / wall-s | tokens / CPU-s | stopped | "
          "same samples every repeat |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in res_sizes:
        for name, m in s["median"].items():
            md.append(f"| {s['sequences']} | {name} | {m['wall_s']:.1f} | {m['cpu_s']:.1f} | {m['cpu_per_wall']:.2f} "
                      f"| {m['tokens']:.0f} | {m['tokens_per_s']:.1f} | {m['tokens_per_cpu_s']:.1f} | "
                      f"{m['stopped']}/{s['sequences']} | {'yes' if m['reproduced_across_repeats'] else 'no'} |")
    md.append("")
    for s in res_sizes:
        r = s["ratio_generate_batch_over_hf_generate"]
        md += [f"- {s['sequences']} sequences, generate_batch / hf_generate, tokens per wall-second: "
               f"{fmt_ratio(r['tokens_per_s'])}; per CPU-second: {fmt_ratio(r['tokens_per_cpu_s'])}"]
    md.append("")
    write_results(a.out, res, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
