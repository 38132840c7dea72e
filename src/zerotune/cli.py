"""`python -m zerotune <stage> <recipe> [section.key=value ...] [--flags]`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from .config import explain, load_recipe
from .errors import UserError, report, why_unreadable
from .hardware import detect
from .hub import family_of_recipe, fetch
from .layout import layout
from .plan import plan_main
from .planner.compute import compute_plan
from .planner.report import dry_run
from .quantize import quantize
from .quiet import silence_known_noise
from .serve import serve
from .train.launch import launch

# the same words as the make targets (make data, make finetune, ...), in the logs and in every hint
STAGES = ["fetch", "data", "inspect", "finetune", "quantize", "check", "eval", "serve", "plan", "explain"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerotune", description="LLM fine-tuning recipes: fetch -> data -> finetune -> quantize -> check -> serve.")
    p.add_argument("stage", choices=STAGES)
    p.add_argument("recipe", nargs="?", default="tiny", help="recipe name in recipes/ or a path to a YAML file")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.lr=1e-4")
    p.add_argument("--rebuild", action="store_true", help="data: rebuild the data cache even if its fingerprint matches")
    p.add_argument("--skip-preflight", action="store_true",
                   help="finetune: start even if the plan predicts it will not fit in memory or on disk")
    p.add_argument("--dry-run", action="store_true", help="finetune: print the resolved plan and exit")
    p.add_argument("--json", action="store_true", help="plan: machine-readable output")
    p.add_argument("--n", type=int, default=2, metavar="N", help="inspect: prepared sequences to show (default 2)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--force" in argv:  # it meant two things before it was split; say which one to use
        return report(UserError("--force is gone: use --rebuild (prepare: rebuild the data cache) or "
                                "--skip-preflight (train: start although the plan predicts it will not fit)."))
    # intermixed: overrides may follow a flag (make inspect ARGS="--n 4 data.seq_len=512"); unknown --flags are refused
    args = _parser().parse_intermixed_args(argv)
    silence_known_noise()
    if args.stage == "explain":
        print(explain())
        return 0
    try:
        r = load_recipe(args.recipe, args.overrides)
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        return _stage(args, r)
    except UserError as e:
        return report(e)


# stage -> (what it does, its output folder in the run's layout), for the one-line banner each stage starts with
BANNERS = {"data": ("tokenize, label and pack the data", lambda run: run.data),
           "inspect": ("show prepared sequences as training sees them, labels highlighted", lambda run: run.inspect),
           "finetune": ("fine-tune the model", lambda run: run.model),
           "quantize": ("export a GGUF with llama.cpp's converter and check it", lambda run: run.gguf_dir),
           "check": ("compare the GGUF with the HF model on held-out prompts", lambda run: run.check)}


def _banner(args, r) -> None:
    """On stdout with the stage's own lines (stderr is for errors); plan, whose --json owns stdout, has none."""
    if args.stage in BANNERS and not args.dry_run:
        what, output = BANNERS[args.stage]
        print(f"== zerotune {args.stage} {r.name}: {what} -> {output(layout(r))}", flush=True)


# stages that read or write a model: its family is checked first, from config.json alone (families.py)
MODEL_STAGES = {"data", "inspect", "finetune", "quantize", "check", "eval", "plan", "serve"}


def _family_first(args, r) -> None:
    """An architecture zerotune does not know is one message listing the supported ones, before anything loads.
    A hub model not fetched yet has no config here: the training worker checks it before it loads weights."""
    family = family_of_recipe(r) if args.stage in MODEL_STAGES else None
    if args.stage == "data" and r.data.replay is not None and family and family.precision_refusal("fp16"):
        gpu = detect()  # data/replay.py answers on this GPU in its auto training precision: fp16 without bf16
        if gpu.capability is not None and not gpu.bf16:
            raise UserError(f"data.replay: the base model would answer on {gpu.name} in fp16 (no bf16 there), and "
                            f"a {family.name} model overflows in fp16 (docs/training.md#model-families). Run `make "
                            "data` on a GPU with bf16, or on the CPU (CUDA_VISIBLE_DEVICES='').")


# stages that write under output_dir
WRITING_STAGES = {"data", "inspect", "finetune", "quantize", "check", "eval", "plan"}


def _output_dir_first(args, r) -> None:
    """An output_dir that cannot be made is one message before any work, not an OSError deep in a stage."""
    if args.stage in WRITING_STAGES and not args.dry_run:
        try:
            r.out.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=r.out).close()  # there and writable (a read-only mount, /proc)
        except OSError as e:
            raise UserError(f"output_dir: cannot create or write in {r.out} ({why_unreadable(e)}): set output_dir to a folder "
                            f"you can write, or leave it out (runs/{r.name}).") from None


def _stage(args, r) -> int:
    _output_dir_first(args, r)
    _family_first(args, r)
    _banner(args, r)
    if args.stage == "fetch":
        return fetch(r)
    # the data pipeline, check and eval import numpy and tqdm (~0.3 s): off every other stage's start-up
    if args.stage == "data":
        from .data.prepare import prepare

        prepare(r, rebuild=args.rebuild)
    elif args.stage == "inspect":
        from .data.view import inspect_data

        inspect_data(r, n=args.n)
    elif args.stage == "finetune":
        if args.dry_run:
            print(dry_run(compute_plan(r), r))
            return 0
        return launch(r, skip_preflight=args.skip_preflight)
    elif args.stage == "quantize":
        quantize(r)
    elif args.stage == "check":
        from .check import check

        return check(r)
    elif args.stage == "eval":
        from .evaluate import evaluate

        return evaluate(r)
    elif args.stage == "serve":
        return serve(r)
    elif args.stage == "plan":
        return plan_main(r, as_json=args.json)
    return 0
