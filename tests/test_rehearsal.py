"""Rehearsal of the llama8b_zero3 job's event sequence on CPU (issue 29).

The 8B recipe's own settings that shape the job's events (a checkpoint every step, validation only at the last
step, how many checkpoints are kept) run on the tiny model under real ZeRO-3 on 2 CPU ranks, through the CLI a
user runs. The phase the suite used never to reach: the last step's validation fails (as an eval forward that
materialises the logits runs out of memory on a V100 at 16K). The step must already be committed, and the job
that comes back (a requeue: the same command) must get through the preflight with the run's checkpoints on disk,
train nothing, skip the validation that failed (saying so) and finish; a job that stopped before validating
its last step validates it when it comes back.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, _zt, read_metrics, zt

pytestmark = pytest.mark.integration


def _event_settings() -> list[str]:
    """The llama8b_zero3 values of what decides when saves and validations happen (read, not copied)."""
    from zerotune.config import load_recipe

    t = load_recipe("llama8b_zero3").train
    return [f"train.save_steps={t.save_steps}", f"train.save_total_limit={t.save_total_limit}",
            f"train.eval_steps={t.eval_steps}"]


@pytest.mark.extended  # 3.5 min; CI: the requeue through sbatch and the last-step decision's units (docs/testing.md)
def test_the_last_step_is_committed_before_its_validation_and_the_requeued_job_finishes(tmp_path):
    out = tmp_path / "run"
    zt("data", "tiny", f"output_dir={out}")
    args = ["finetune", "tiny", f"output_dir={out}", "train.max_steps=3", "train.logging_steps=1", *_event_settings()]
    env = {**os.environ, "ZEROTUNE_FAULT_EVAL_OOM_STEP": "3"}
    proc = subprocess.run([sys.executable, "-m", "zerotune", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "CUDA out of memory (injected)" in log, log[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "checkpoint-3" / "zerotune_commit.json").exists(), "the last step was lost with its validation"
    assert log.index("checkpoint: committed checkpoint-3") < log.index("CUDA out of memory (injected)")
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint-2", "checkpoint-3"]  # save_total_limit 2
    assert not (out / "model").exists()

    # the requeued job's disk preflight, on a file system with less free space than a fresh run needs: the run's
    # own committed checkpoints (the real ones just written) count as used, so it goes on
    import shutil
    from collections import namedtuple

    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.gate import disk_preflight

    r = load_recipe("tiny", args[2:])
    plan = compute_plan(r)
    disk_preflight(plan, r, out)  # no error
    fresh = plan.disk.peak_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shutil, "disk_usage", lambda p: namedtuple("usage", "total used free")(10 * fresh, 0, fresh - 1))
        plan = compute_plan(r)
        disk_preflight(plan, r, out)  # no error: the run's own checkpoints count as used
    d = plan.disk
    assert d.held.checkpoints == 2 and d.needed_free_bytes < fresh - 1

    # the requeued job (the same command) resumes at the last step: nothing to train; the validation that failed
    # would fail again (a deterministic out-of-memory), so it is skipped and said; the job finishes
    log2 = _zt(*args)
    assert "resuming from committed checkpoint" in log2 and "checkpoint-3" in log2
    assert "resumed at the last step (3 of 3): nothing left to train" in log2
    assert "step 3 validation skipped: it failed in the previous attempt (OutOfMemoryError" in log2, log2[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3], "each step once, none retrained"
    assert (out / "model" / "config.json").exists()

    # a job stopped at the last step before validating it (no failure recorded): the next attempt validates it,
    # amends the step's row and replaces no samples twice
    (out / "train" / "validation_failed.json").unlink()
    log3 = _zt(*args)
    assert "finetune: eval: step 3, val_loss" in log3, log3[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and "val_loss" in rows[-1]
    samples = [json.loads(x) for x in (out / "train" / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [3] * len(samples) and samples


@pytest.mark.extended  # ~5 min; CI: the last-step decision's units in test_slurm.py (docs/testing.md)
def test_a_deadline_with_room_for_two_saves_but_not_the_samples_requeues_before_the_kill(tmp_path):
    """Issue 41: at 8B across nodes the end of training's samples take minutes, and a job killed inside them is not
    requeued. Real ZeRO-3 on 2 CPU ranks, the samples made slow (200 s, faults.py), a validation at step 1 that
    measures them, and a deadline that leaves the last step room for two saves but not for the samples: the job
    commits step 2 and exits REQUEUE_EXIT before the deadline, when a stand-in for SLURM kills it; the requeued job
    validates and finalizes. (Reserving only the two saves, it would go into the samples and be killed.)"""
    import signal
    import threading
    import time

    from zerotune.stopping import REQUEUE_EXIT, seconds_needed

    out, log = tmp_path / "run", tmp_path / "finetune.log"
    zt("data", "tiny", f"output_dir={out}")
    args = ["finetune", "tiny", f"output_dir={out}", "train.max_steps=2", "train.logging_steps=1",
            "train.save_steps=1", "train.eval_steps=1"]
    slow_s, after_step_2 = 200, 130  # the deadline ~130 s after step 2: two saves need ~65 s, the samples ~220 s more
    launched = time.time()
    # launch to step 1 takes ~30-60 s here: the deadline tolerates +-60 s of that (the asserts below check it held)
    deadline = launched + 45 + slow_s + after_step_2
    env = {**os.environ, "ZEROTUNE_DEADLINE": str(deadline), "ZEROTUNE_FAULT_SLOW_SAMPLES": str(slow_s)}
    with open(log, "w+") as f:
        proc = subprocess.Popen([sys.executable, "-m", "zerotune", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        killer = threading.Timer(deadline - time.time(), lambda: os.killpg(proc.pid, signal.SIGKILL))
        killer.start()  # SLURM at the time limit (its SIGTERM's grace is spent on the margin here)
        try:
            proc.wait(timeout=deadline - time.time() + 60)
        finally:
            killer.cancel()
    text = log.read_text()
    assert proc.returncode == REQUEUE_EXIT, f"exit {proc.returncode} (-9: killed at the deadline)\n{text[-3000:]}"
    assert time.time() < deadline
    m = re.search(r"the job ends in ([\d,]+) s and the end of training needs ~([\d,]+) s \(validation and samples "
                  r"~([\d,]+) s measured", text)
    assert m, text[-3000:]
    left, need, end_s = (float(g.replace(",", "")) for g in m.groups())
    assert end_s >= slow_s and need > left, "the measured samples were not reserved"
    markers = (out / "checkpoints").glob("*/zerotune_commit.json")
    save_s = max(json.loads(m.read_text()).get("save_s") or 0.0 for m in markers)
    assert seconds_needed(0, 2 * save_s) < left, "the premise: room for two saves (the machine was too slow)"
    assert (out / "checkpoints" / "checkpoint-2" / "zerotune_commit.json").exists() and not (out / "model").exists()

    log2 = _zt(*args)  # the requeued job, its samples as fast as they are
    assert "resumed at the last step (2 of 2): nothing left to train" in log2, log2[-3000:]
    assert "finetune: eval: step 2" in log2 and (out / "model" / "config.json").exists()
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
