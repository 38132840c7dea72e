"""On-policy preference pairs for recipe smollm2_dpo: the smollm2 SFT model's own mistakes as the rejected records.

Why: pairs whose rejected record is a synthetic mistake (make_smollm2_data.py wrong_record: the age off, the name
cut, a training city or job, the job capitalised, prose after the JSON) leave DPO nothing to fix on this model. The
SFT model already ranks all 60 held-out correct records above such mistakes (measured 2026-11-27), and its real
errors are other ones: 17 of its 18 wrong held-out answers miscopy the city into a familiar-looking word ("Split" ->
"Sterling", "Lucerne" -> "Liberne", "Porto" -> "Portso"), 2 capitalise the job. So, as in on-policy DPO, the SFT
model answers the prompts greedily (zerotune's own answering path, as `make eval` answers) and each wrong answer
becomes a pair: chosen = the correct record, rejected = what the model said.

- pairs.jsonl: prompts of the third vocabulary (make_smollm2_data.py D_*, disjoint from the SFT data and the held-out
  set) in the training and D sentence shapes; one pair per wrong answer.
- heldout_pairs.jsonl: the 60 held-out prompts. Where the SFT model is wrong, its answer is the rejected record
  (its preference accuracy there is ~0 by construction); where it is right, one synthetic mistake as before. The
  start then scores below 1.0 on the held-out pairs and a gain can show.

Run after the SFT run (`make data finetune RECIPE=smollm2`), from the repo root:
    .venv/bin/python scripts/make_smollm2_dpo_pairs.py [--model runs/smollm2/model] [--prompts 800]
The output is committed: the answers of the SFT model trained by the smollm2 recipe on this machine; another run
of that recipe makes nearly the same mistakes, and the held-out pairs stay a fixed test either way.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))

from make_smollm2_data import (D_CITIES, D_FIRST, D_JOBS, D_LAST, D_SHAPES, TRAIN_SHAPES, example,  # noqa: E402
                               person, wrong_record)

OUT = REPO / "data" / "smollm2"
MAX_NEW_TOKENS = 48  # a record is ~30 tokens; as the recipe's task set


def answers(model_dir: Path, prompts: list[str]) -> list[str]:
    from zerotune.answering import hf_generate, load_hf

    model, tok, stop = load_hf(model_dir, tokenizer=REPO / "assets" / "models" / "smollm2-135m-instruct")
    rows = [{"messages": [{"role": "user", "content": p}]} for p in prompts]
    return hf_generate(model, tok, stop, rows, MAX_NEW_TOKENS, batch_size=16)


def right(answer: str, reference: str) -> bool:
    from zerotune.scorers import score

    return score("json_fields", answer, {"answer": reference}) == 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "runs" / "smollm2" / "model")
    ap.add_argument("--prompts", type=int, default=800, help="training prompts answered (pairs: the wrong answers)")
    a = ap.parse_args()
    if not (a.model / "config.json").exists():
        print(f"make_smollm2_dpo_pairs: no SFT model at {a.model}: run `make data finetune RECIPE=smollm2` first",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rng = random.Random(2)
    train = [example(rng, person(rng, D_FIRST, D_LAST, D_CITIES, D_JOBS), D_SHAPES + TRAIN_SHAPES)
             for _ in range(a.prompts)]
    heldout = [json.loads(line) for line in open(OUT / "heldout.jsonl")]
    held = [(r["messages"][-1]["content"], r["answer"]) for r in heldout]
    said = answers(a.model, [p for p, _ in train + held])
    said_train, said_held = said[:len(train)], said[len(train):]

    pairs = [{"prompt": p, "chosen": ref, "rejected": s} for (p, ref), s in zip(train, said_train) if not right(s, ref)]
    with open(OUT / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in pairs)
    on_policy = 0
    with open(OUT / "heldout_pairs.jsonl", "w") as f:
        for (p, ref), s in zip(held, said_held):
            wrong = not right(s, ref)
            on_policy += wrong
            f.write(json.dumps({"prompt": p, "chosen": ref,
                                "rejected": s if wrong else wrong_record(rng, json.loads(ref))}) + "\n")
    print(f"make_smollm2_dpo_pairs: the SFT model ({a.model}) got {len(pairs)} of {len(train)} training prompts wrong "
          f"-> {OUT / 'pairs.jsonl'} ({len(pairs)} pairs); {on_policy} of {len(held)} held-out prompts wrong -> "
          f"{OUT / 'heldout_pairs.jsonl'} ({on_policy} on-policy pairs, {len(held) - on_policy} synthetic) "
          f"in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
