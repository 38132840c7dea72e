"""Runs that survive: SIGUSR1 -> committed checkpoint -> exit 75 -> rerun resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_integration import REPO, metrics, zt

pytestmark = pytest.mark.integration
STEPS = 10


def test_sigusr1_checkpoints_and_resume_matches_uninterrupted_run(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = ["train.logging_steps=1", f"train.max_steps={STEPS}"]
    for out in (ref, run):
        zt("prepare", "tiny", f"output_dir={out}")
    zt("train", "tiny", f"output_dir={ref}", *common)

    logfile = open(tmp_path / "interrupted.log", "w+")  # a file, not a pipe: a full pipe would block the workers
    proc = subprocess.Popen([sys.executable, "-m", "zerotune", "train", "tiny", f"output_dir={run}", *common],
                            cwd=REPO, stdout=logfile, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    mfile = run / "train" / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if mfile.exists() and len(mfile.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    # What slurm/finetune.sbatch's trap does: USR1 to the workers (torchrun's children), not to torchrun.
    subprocess.run(["pkill", "-USR1", "-f", f"python[^ ]* -u -m zerotune train tiny output_dir={run}"], check=True)
    proc.wait(timeout=600)
    log = (tmp_path / "interrupted.log").read_text()
    assert proc.returncode == 75, log[-3000:]
    assert "SIGUSR1 received: checkpointing at step" in log
    stopped = json.loads((run / "train" / "stopped.json").read_text())
    assert 3 <= stopped["step"] < STEPS and stopped["signal"] == "SIGUSR1"
    assert (Path(stopped["checkpoint"]) / "zerotune_commit.json").exists()
    assert not (run / "model").exists(), "a stopped run must not publish a final model"

    resumed = zt("train", "tiny", f"output_dir={run}", *common).stdout
    assert f"resuming from committed checkpoint {stopped['checkpoint']}" in resumed
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6), (x, y)


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    from zerotune.checkpoint import MARKER, last_committed

    root = tmp_path / "checkpoints"
    for step, committed in ((2, True), (4, True), (6, False)):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(b"x")
        if committed:
            (d / MARKER).write_text("{}")
    assert last_committed(root) == root / "checkpoint-4"
