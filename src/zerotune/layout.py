"""Where a run's files live: every path a stage reads or writes, stated once, in the order the stages run.

    <output_dir>/                     recipe `output_dir` (default runs/<recipe>)
      replay/        data             answers-<key>.jsonl + answers-<key>.json (the counts): the base model's answers
                                      to data.replay's prompts, kept across data rebuilds
      data/          data             train/ eval/ (Arrow), manifest.json (fingerprint, counts), lengths.png
      inspect/       inspect          sequences.html: prepared sequences as training sees them, labels highlighted
      base/          finetune         a random init materialised from model.init_config, zerotune_base.json (what it
                                      was made from); none when model.name_or_path names the base
      train/         finetune         metrics.jsonl, samples.jsonl, rollouts.jsonl (GRPO), validation_failed.json,
                                      curves.png, manifest.json;
                                      handoff between its processes: recipe.resolved.yaml and plan.json (written by
                                      the launcher, read by every rank and finalize), run.json, stopped.json,
                                      error.json, error.rank<N>.json; between sbatch attempts:
                                      stopped_before_training.json
      reference/     finetune (DPO)   logps.pt + manifest.json: the starting model's log-probs of every pair, computed
                                      once before the first step, keyed by data, weights and numerics
      checkpoints/   finetune         checkpoint-<step>/ (DeepSpeed shards + zerotune_commit.json; universal/: its
                                      conversion for another world size, reshard.py)
      model.tmp/     finetune         the consolidated save, verified before it becomes model/ (PEFT: the adapter)
      model.merged.tmp/  finetune (PEFT)  base + adapter merged, verified before it becomes model/
      model/         finetune         the published HF model (PEFT: base + adapter, merged)
      adapter/       finetune (PEFT)  the adapter alone
      gguf/          quantize         <recipe>-<type>.gguf, manifest.json
      eval/          eval             eval.json, eval.png, answers.json (eval and check: every model's answers),
                                      pairs.json (held-out pairs' log-probs), lm_eval_task/ (lm-eval's local task)
      check/         check            check.json
      plan/          plan             plan.json, memory.png
    slurm/logs/<job>-<id>.out         every sbatch's log (set in each script's #SBATCH --output)

recipe.resolved.yaml, the recipe that made a folder (overrides applied, write_resolved_recipe), is in data/,
inspect/, train/, gguf/, eval/, check/ and plan/. What is published whole (data/, base/, model/, adapter/, the GGUF,
universal/) is built as <name>.tmp beside it and renamed in (manifest.publish; <name>.old for the instant between
the two renames).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from . import manifest as mf
from .config import RECIPES_DIR, REPO_ROOT, Recipe, resolve_path

RESOLVED_RECIPE = "recipe.resolved.yaml"  # in each stage's output folder: the recipe that made it


@dataclass(frozen=True)
class RunLayout:
    out: Path
    base: Path | None = None  # these two depend on the recipe (see layout()); the rest only on `out`
    gguf: Path | None = None

    @property
    def replay(self) -> Path:  # data.replay's cache: kept across data rebuilds (answering takes minutes to hours)
        return self.out / "replay"

    def replay_answers(self, key: str) -> Path:  # the conversations (JSONL); beside it <key>.json, the counts
        return self.replay / f"answers-{key}.jsonl"

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def data_train(self) -> Path:  # data -> finetune: the packed training rows (Arrow)
        return self.data / "train"

    @property
    def data_eval(self) -> Path:  # data -> validation during training, check's logit comparison
        return self.data / "eval"

    @property
    def data_manifest(self) -> Path:  # data -> finetune, plan, quantize: fingerprint, counts, lengths
        return self.data / "manifest.json"

    @property
    def inspect(self) -> Path:
        return self.out / "inspect"

    @property
    def inspect_html(self) -> Path:  # inspect: the prepared sequences, labels highlighted (data/view.py)
        return self.inspect / "sequences.html"

    @property
    def base_stamp(self) -> Path:  # what a random-init base was made from; reused while it matches
        return self.base / "zerotune_base.json"

    @property
    def train(self) -> Path:
        return self.out / "train"

    @property
    def reference(self) -> Path:  # DPO: the reference log-probs (preference/reference.py), read by every resume
        return self.out / "reference"

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def model_staging(self) -> Path:
        return self.out / "model.tmp"

    @property
    def model(self) -> Path:
        return self.out / "model"

    @property
    def adapter(self) -> Path:
        return self.out / "adapter"

    @property
    def gguf_dir(self) -> Path:
        return self.gguf.parent

    @property
    def gguf_manifest(self) -> Path:
        return self.gguf_dir / "manifest.json"

    @property
    def eval(self) -> Path:
        return self.out / "eval"

    @property
    def eval_json(self) -> Path:
        return self.eval / "eval.json"

    @property
    def eval_png(self) -> Path:
        return self.eval / "eval.png"

    @property
    def answers(self) -> Path:  # eval and check: every model's answers, keyed by model, set and prompts
        return self.eval / "answers.json"

    @property
    def check(self) -> Path:
        return self.out / "check"

    @property
    def check_json(self) -> Path:
        return self.check / "check.json"

    @property
    def plan(self) -> Path:
        return self.out / "plan"

    @property
    def plan_json(self) -> Path:
        return self.plan / "plan.json"

    @property
    def plan_png(self) -> Path:
        return self.plan / "memory.png"

    # train/: what one run's processes write for each other and for the stages after it
    @property
    def run_recipe(self) -> Path:  # launcher -> every rank and finalize: the recipe resolved once, overrides applied
        return self.train / RESOLVED_RECIPE

    @property
    def run_plan(self) -> Path:  # launcher -> every rank: the launch's Plan (phase times the deadline reserves)
        return self.train / "plan.json"

    @property
    def train_manifest(self) -> Path:  # finalize -> quantize, check: how the published model was trained
        return self.train / "manifest.json"

    @property
    def curves(self) -> Path:
        return self.train / "curves.png"

    @property
    def metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def samples(self) -> Path:
        return self.train / "samples.jsonl"

    @property
    def rollouts(self) -> Path:  # GRPO: one prompt's group per step, its completions with their rewards
        return self.train / "rollouts.jsonl"

    @property
    def validation_failed(self) -> Path:  # an attempt -> the next: this step's validation failed, don't retry it
        return self.train / "validation_failed.json"

    @property
    def run_json(self) -> Path:  # workers -> finalize: step, stop reason, timings
        return self.train / "run.json"

    @property
    def stopped(self) -> Path:  # workers -> launcher / sbatch: stopped early at this step, for this reason
        return self.train / "stopped.json"

    @property
    def no_progress(self) -> Path:  # sbatch attempt -> the next attempt: stopped before training a step
        return self.train / "stopped_before_training.json"


def layout(r: Recipe) -> RunLayout:
    if r.model.name_or_path:
        p = resolve_path(r.model.name_or_path)
        base = p if p.exists() else Path(r.model.name_or_path)  # not a local folder: a hub id
    else:
        base = r.out / "base"
    return RunLayout(out=r.out, base=base, gguf=r.out / "gguf" / f"{r.name}-{r.quantize.type.lower()}.gguf")


def producing_recipe(folder: Path) -> str | None:
    """The shipped recipe whose default run folder publishes `folder` as its model (runs/<name>/model): a recipe that
    starts from another run's model (smollm2_dpo from smollm2's) names the run to make first."""
    folder = Path(folder).resolve()
    if folder.name != "model" or folder.parent.parent != (REPO_ROOT / "runs").resolve():
        return None
    name = folder.parent.name
    return name if (RECIPES_DIR / f"{name}.yaml").exists() else None


def upstream_to_train(r: Recipe) -> str | None:
    """`make demo`: the recipe to train first, when this one starts from its run's model and that is not published
    yet; None otherwise."""
    p = resolve_path(r.model.name_or_path) if r.model.name_or_path else None
    if p is None or (p / "config.json").exists():
        return None
    return producing_recipe(p)


def write_resolved_recipe(folder: Path, r: Recipe) -> None:
    """The recipe that made a stage's output, overrides applied, beside it as RESOLVED_RECIPE (train/: what its
    processes read, RunLayout.run_recipe)."""
    mf.write_atomic(Path(folder) / RESOLVED_RECIPE, yaml.safe_dump(r.to_dict(), sort_keys=False))  # never half a recipe
