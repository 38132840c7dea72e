"""What the training benchmark's contenders are built from: paths, the bench recipe, TRL, the padded data.

The bench recipe (bench/recipes/bench_train.yaml) is the one source of model, data and hyper-parameters;
TRL is installed for the benchmark only (bench/work/trl-site, not .venv: see bench/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
WORK = BENCH / "work" / "train"
TRL_SITE = BENCH / "work" / "trl-site"
RECIPE = BENCH / "recipes" / "bench_train.yaml"  # model, data and every hyper-parameter of every contender
CHATML_TRAINING = BENCH / "recipes" / "chatml_training.jinja"  # TRL's assistant-only masks for SmolLM2's ChatML
CHAT = WORK / "chat.jsonl"  # the path bench/recipes/bench_train.yaml reads
ZT_OUT = WORK / "zerotune"
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(BENCH))

CONFIGS = ("zerotune", "zerotune_lora", "trainer_padded", "trl_default", "trl_packing")
LABELS = {"zerotune": "zerotune (packed, CLI)", "zerotune_lora": "zerotune LoRA r16 (packed, CLI)",
          "trainer_padded": "transformers Trainer, padded per batch",
          "trl_default": "TRL SFTTrainer, default (padded)", "trl_packing": "TRL SFTTrainer, packing=True"}


def recipe(overrides: list[str]):
    from zerotune.config import load_recipe

    return load_recipe(str(RECIPE), overrides)


def procs() -> int:
    return recipe([]).train.cpu_procs


def zt_overrides(a) -> list[str]:
    return [f"output_dir={ZT_OUT.relative_to(REPO)}", f"data.seq_len={a.seq_len}",
            f"train.max_steps={a.steps}", f"train.global_batch_tokens={a.seq_len * procs() * a.grad_accum}"]


# ---------------------------------------------------------------------------------------------------------------
# TRL: installed for the benchmark only, into bench/work/trl-site (not into .venv)

def trl_requirement() -> str:
    for line in (BENCH / "requirements-bench.txt").read_text().splitlines():
        if line.strip().startswith("trl=="):
            return line.split()[0]
    raise RuntimeError("bench/requirements-bench.txt pins no trl version")


def ensure_trl() -> dict:
    """Install the pinned TRL into bench/work/trl-site if missing; check its install requirements against .venv."""
    from importlib import metadata

    from packaging.requirements import Requirement

    want = trl_requirement().split("==")[1]
    if not (TRL_SITE / f"trl-{want}.dist-info").exists():
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade",
                               "--target", str(TRL_SITE), "-r", str(BENCH / "requirements-bench.txt")])
    dist = next(metadata.distributions(path=[str(TRL_SITE)], name="trl"))
    checks = []
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        checks.append({"requirement": spec, "installed": have,
                       "ok": have is not None and req.specifier.contains(have, prereleases=True)})
    bad = [c for c in checks if not c["ok"]]
    if bad:
        raise RuntimeError(f"trl {dist.version} needs packages .venv does not satisfy: {bad}")
    return {"version": dist.version, "installed_to": str(TRL_SITE.relative_to(REPO)),
            "install": "pip install --no-deps --target bench/work/trl-site -r bench/requirements-bench.txt",
            "requirements_checked": checks}


def trl_chat_template() -> str | None:
    """TRL's own training template where it has one for the model's template (Llama-3), else ours (ChatML)."""
    from trl.chat_template_utils import get_training_chat_template

    from zerotune.data.cache import load_tokenizer

    try:
        get_training_chat_template(load_tokenizer(recipe([])))
        return None  # TRL swaps in its own (Llama-3), or the template has the markers already
    except ValueError:  # TRL: "patching is not supported for this template. Please manually modify [it]"
        return str(CHATML_TRAINING)


def trl_label_check(n: int) -> dict:
    """TRL's assistant masks (with the training template its runs use) vs zerotune's labels, first n conversations."""
    sys.path.insert(0, str(TRL_SITE))
    from trl.chat_template_utils import get_training_chat_template

    from bench_data import baseline
    from zerotune.data.cache import load_tokenizer

    tok = load_tokenizer(recipe([]))
    path = trl_chat_template()
    tmpl = Path(path).read_text() if path else get_training_chat_template(tok) or tok.chat_template
    with open(CHAT) as f:
        convs = [json.loads(x)["messages"] for _, x in zip(range(n), f)]
    same = 0
    for m, (ids, lab) in zip(convs, baseline(tok, convs)[0]):
        o = tok.apply_chat_template(m, chat_template=tmpl, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        same += list(o["input_ids"]) == ids and [i if k else -100 for i, k in zip(o["input_ids"], o["assistant_masks"])] == lab
    return {"conversations": n, "identical_ids_and_labels": same}


# ---------------------------------------------------------------------------------------------------------------
# The plain user's data for the padded contenders

def tokenize_padded(a, n: int, path: Path) -> dict:
    """The plain user's data: chat template, per-turn prefix labels (bench_data.baseline), truncate to seq_len."""
    import numpy as np
    from datasets import Dataset

    from bench_data import baseline
    from zerotune.data.cache import load_tokenizer

    tok = load_tokenizer(recipe(zt_overrides(a)))
    with open(CHAT) as f:
        convs = [json.loads(x)["messages"] for _, x in zip(range(n), f)]
    docs, secs = baseline(tok, convs)
    ids, labels, dropped = [], [], 0
    for i, l in docs:
        i, l = i[: a.seq_len], l[: a.seq_len]
        if all(x == -100 for x in l):
            dropped += 1  # no label left after truncation: 0/0 loss (zerotune drops these too)
            continue
        ids.append(i)
        labels.append(l)
    Dataset.from_dict({"input_ids": ids, "labels": labels}).save_to_disk(str(path))
    lengths = np.array([len(x) for x in ids])
    return {"documents": len(ids), "dropped_no_labels": dropped, "tokenize_s": round(secs, 1),
            "mean_doc_tokens": float(lengths.mean()), "lengths": lengths,
            "label_fraction": sum(sum(x != -100 for x in l) for l in labels) / int(lengths.sum())}


def expected_padding_efficiency(lengths, b: int, seed: int = 0) -> float:
    """Real / padded tokens of random micro-batches of b documents padded to their longest."""
    import numpy as np

    rng = np.random.default_rng(seed)
    effs = []
    for _ in range(20):
        idx = rng.permutation(len(lengths))[: len(lengths) // b * b].reshape(-1, b)
        effs.append(lengths[idx].sum() / (lengths[idx].max(1).sum() * b))
    return float(np.mean(effs))
