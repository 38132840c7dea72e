"""Batched greedy answers vs one prompt at a time: the HF side of `zerotune eval`, `check` and `data.replay`.

    .venv/bin/python bench/bench_answers.py [--prompts 16] [--new-tokens 48] [--batch 16] [--repeats 3] [--out PATH]

SmolLM2-135M-Instruct answers the first --prompts prompts of data/general/prompts.jsonl greedily, up to
--new-tokens each, through zerotune.answering.hf_answers: once with --batch prompts per generate() call (left
padding, longest first) and once with 1. The two take turns in every repeat (who goes first alternates), in one
process with the model loaded once and warmed up, so load drift on this shared VM hits both sides of a ratio
alike. The answers must be identical token for token (the benchmark fails otherwise: a faster wrong answer is no gain).
Reported per wall-second and per CPU-second (process time, which leaves out what other guests took).
Writes bench/results/answers.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench_env import REPO, RESULTS, SMOLLM2  # first: the hub offline, src/ on the path

from bench_stats import Steal, fmt_ratio, ratio_stats, timed, write_results  # noqa: E402

MODEL = SMOLLM2
PROMPTS = REPO / "data" / "general" / "prompts.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "answers", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    from zerotune.answering import hf_answers, load_hf
    from zerotune.quiet import silence_known_noise

    silence_known_noise()
    model, tok, stop = load_hf(MODEL)
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines()[:a.prompts]]
    # warm-up: the first generate() of a process pays for lazy initialisation (a 16-prompt batch took 63 s cold and
    # 5.5 s warm here); neither side of the ratio should carry it
    hf_answers(model, tok, stop, rows[:2], 2, 2)
    hf_answers(model, tok, stop, rows[:1], 2, 1)
    steal = Steal()
    runs = {"batched": [], "one_at_a_time": []}
    answers = {}
    for rep in range(a.repeats):
        order = [("batched", a.batch), ("one_at_a_time", 1)]
        for name, bs in (order if rep % 2 == 0 else order[::-1]):
            out, wall, cpu, _ = timed(lambda: hf_answers(model, tok, stop, rows, a.new_tokens, bs))
            runs[name].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
            answers.setdefault(name, out)
            print(f"bench answers: repeat {rep + 1}/{a.repeats} {name:<14} {wall:6.1f} s wall {cpu:6.1f} s CPU",
                  flush=True)
    if answers["batched"] != answers["one_at_a_time"]:
        diff = next(i for i, (x, y) in enumerate(zip(answers["batched"], answers["one_at_a_time"])) if x != y)
        raise SystemExit(f"bench answers: batched answer {diff} differs from the one-at-a-time answer: "
                         f"{answers['batched'][diff]!r} vs {answers['one_at_a_time'][diff]!r}")
    ratio = {clock: ratio_stats([o[clock] / b[clock] for b, o in zip(runs["batched"], runs["one_at_a_time"])])
             for clock in ("wall_s", "cpu_s")}
    res = {"setup": {"model": "SmolLM2-135M-Instruct (fp32, CPU)", "prompts": a.prompts, "new_tokens": a.new_tokens,
                     "batch": a.batch, "repeats": a.repeats, "threads": os.cpu_count()},
           "runs": runs, "identical_answers": True, "finished": sum(f for _, f in answers["batched"]),
           "speedup": ratio, "steal": steal.fraction()}
    md = ["# Batched answers (SmolLM2-135M, HF generate)", "",
          f"{a.prompts} prompts of data/general/prompts.jsonl, up to {a.new_tokens} new tokens each, greedy, "
          f"{a.batch} per generate() call (left-padded) against one at a time; identical answers "
          f"({res['finished']} of {a.prompts} ended before the limit). CPU steal {res['steal']}.", "",
          f"- per wall-second: {fmt_ratio(ratio['wall_s'])}",
          f"- per CPU-second: {fmt_ratio(ratio['cpu_s'])}", ""]
    write_results(a.out, res, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
