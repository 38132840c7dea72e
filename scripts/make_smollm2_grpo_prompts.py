"""Prompts for recipe smollm2_grpo: the extraction prompts smollm2_dpo's pairs were drawn from, each with its
correct record as the reference the reward compares a completion with.

The same 800 prompts as scripts/make_smollm2_dpo_pairs.py (the third vocabulary, make_smollm2_data.py D_*, disjoint
from the SFT data and the held-out set; the same seed), all of them: DPO kept the 476 the SFT model answered wrong,
GRPO samples every prompt group_size times and learns from the groups whose answers differ. Written as chat rows
(user prompt, assistant reference), the format SFT data already has, so `make data` reads them as it reads any.

    .venv/bin/python scripts/make_smollm2_grpo_prompts.py     # -> data/smollm2/grpo_prompts.jsonl (committed)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from make_smollm2_data import D_CITIES, D_FIRST, D_JOBS, D_LAST, D_SHAPES, TRAIN_SHAPES, example, person  # noqa: E402

PROMPTS = 800  # make_smollm2_dpo_pairs.py --prompts


def main() -> int:
    rng = random.Random(2)  # make_smollm2_dpo_pairs.py's: the same prompts in the same order
    out = REPO / "data" / "smollm2" / "grpo_prompts.jsonl"
    with open(out, "w") as f:
        for _ in range(PROMPTS):
            prompt, answer = example(rng, person(rng, D_FIRST, D_LAST, D_CITIES, D_JOBS), D_SHAPES + TRAIN_SHAPES)
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    print(f"make_smollm2_grpo_prompts: {PROMPTS} prompts with their records -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
