"""The processes of a training run start from the run folder, not from argv: the launcher resolves the recipe once
into train/recipe.resolved.yaml, and every rank and finalize read that file (src/zerotune/train/__main__.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from zerotune.config import RECIPES_DIR, load_recipe
from zerotune.layout import RunLayout, write_resolved_recipe


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_the_resolved_recipe_reads_back_as_the_same_recipe(name, tmp_path):
    r = load_recipe(name, [f"output_dir={tmp_path}", "train.lr=3e-5", "plan.nodes=4"])
    write_resolved_recipe(RunLayout(r.out).train, r)
    assert load_recipe(str(RunLayout(r.out).run_recipe)) == r  # what every rank trains with is what was launched


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_worker_without_a_launched_run_says_how_it_is_started(tmp_path):
    p = _run("-m", "zerotune.train", "finalize", str(tmp_path))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"zerotune: {tmp_path}/train/recipe.resolved.yaml not found: these processes are started by `make "
        "finetune RECIPE=...` or slurm/finetune.sbatch, which write it first."]


@pytest.mark.slow
def test_the_user_cli_has_no_internal_process_flags():
    p = _run("-m", "zerotune", "finetune", "tiny", "--finalize")  # argparse refuses it before anything runs
    assert p.returncode == 2 and "unrecognized arguments: --finalize" in p.stderr
    assert _run("-m", "zerotune.train").returncode == 2  # no role: its usage, not a traceback
