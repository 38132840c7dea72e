"""Generate the tiny recipe's synthetic chat data (data/tiny/*.jsonl).

The task is copying: "Repeat after me: red cat apple" -> "You said: red cat apple": a
colour, an animal and a thing, each a single token in the Llama-3 tokenizer. Each
answer slot copies the prompt word of its class, which one attention layer can
learn in about a hundred CPU steps (a plain positional copy takes many more).
Held-out prompts are word triples that never occur in the training file, so a
model that scores on them has learned to copy, not memorised answers. A random
initialisation scores 0; the check stage scores exact matches.

Preference pairs for the tiny DPO recipe (data/tiny/pairs.jsonl, TRL's prompt/chosen/rejected): the same
prompts, the correct copy chosen and a copy with one word swapped for another of its class rejected; held-out
pairs (data/tiny/heldout_pairs.jsonl) use the held-out triples.

Run: python scripts/make_tiny_data.py   (output is committed; rerunning is deterministic)
"""

import itertools
import json
import random
from pathlib import Path

COLOURS = "red blue green yellow black white pink purple orange brown gray gold silver".split()
ANIMALS = "cat dog horse sheep tiger eagle mouse snake bear wolf lion fish duck goat frog".split()
THINGS = "apple bread cake rice lemon honey cheese soup milk tea chair table stone river cloud".split()
SYSTEM = "You repeat what the user says after 'Repeat after me:'."


def conversation(words, with_system: bool) -> dict:
    text = " ".join(words)
    msgs = [{"role": "system", "content": SYSTEM}] if with_system else []
    msgs += [{"role": "user", "content": f"Repeat after me: {text}"},
             {"role": "assistant", "content": f"You said: {text}"}]
    return {"messages": msgs}


def main(out_dir: Path = Path(__file__).resolve().parents[1] / "data" / "tiny", n_heldout: int = 100) -> None:
    rng = random.Random(0)
    triples = list(itertools.product(COLOURS, ANIMALS, THINGS))
    rng.shuffle(triples)
    heldout, train = triples[:n_heldout], triples[n_heldout:]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train.jsonl", "w") as f:
        for i, t in enumerate(train):
            f.write(json.dumps(conversation(t, with_system=i % 4 == 0)) + "\n")
    with open(out_dir / "heldout.jsonl", "w") as f:
        for t in heldout:
            conv = conversation(t, with_system=False)
            f.write(json.dumps({"messages": conv["messages"][:-1], "answer": "You said: " + " ".join(t)}) + "\n")

    pairs(out_dir, train[:600], heldout[:40])


def pairs(out_dir: Path, train, heldout) -> None:
    rng = random.Random(1)
    classes = (COLOURS, ANIMALS, THINGS)
    for name, triples in (("pairs.jsonl", train), ("heldout_pairs.jsonl", heldout)):
        with open(out_dir / name, "w") as f:
            for t in triples:
                k = rng.randrange(3)
                wrong = list(t)
                wrong[k] = rng.choice([w for w in classes[k] if w != t[k]])
                f.write(json.dumps({"prompt": f"Repeat after me: {' '.join(t)}", "chosen": f"You said: {' '.join(t)}",
                                    "rejected": f"You said: {' '.join(wrong)}"}) + "\n")


if __name__ == "__main__":
    main()
