"""slurm/*.sbatch on a real two-node SLURM cluster (scripts/slurm_local_cluster.sh): prepare -> finetune on 2 nodes
x 1 CPU process (ZeRO-3 over gloo) -> a time-limit USR1 mid-run -> committed checkpoint -> automatic requeue ->
resume -> the same per-step losses as an uninterrupted run -> quantize. Also a USR1 while the workers start,
scancel mid-run followed by a manual resubmit, a 2-node checkpoint resubmitted on 1 node, and a USR1 while the
preflight converts such a checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RESUME_COMMON, RESUME_STEPS
from slurm_cluster import REPO, start_cluster, wait_until

pytestmark = pytest.mark.integration
STEPS, COMMON = RESUME_STEPS, RESUME_COMMON  # the uninterrupted reference is conftest's tiny_reference_10
NODES = ["--nodes=2", "--time=30"]  # a time limit, so the deadline path is wired (30 min: never reached here)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster, stop = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    stop()


def metrics(out: Path) -> list[dict]:
    f = out / "train" / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def last_step(out: Path) -> int:
    rows = metrics(out)
    return rows[-1]["step"] if rows else 0


def assert_matches_reference(reference: Path, out: Path) -> None:
    a, b = metrics(reference), metrics(out)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), "every step exactly once"
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6), (x, y)


def finetune(slurm, out: Path) -> str:
    return slurm.sbatch(*NODES, "slurm/finetune.sbatch", "tiny", f"output_dir={out}", *COMMON, "train.cpu_procs=1")


@pytest.fixture(scope="module")
def prepared(slurm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slurm_run")
    job = slurm.sbatch("slurm/prepare.sbatch", "tiny", f"output_dir={out}")
    info = slurm.wait_final(job)
    assert info["JobState"] == "COMPLETED", slurm.log_tail(job, "zerotune-prepare")
    return out


@pytest.fixture(scope="module")
def reference(prepared, tiny_reference_10) -> Path:
    """The same run uninterrupted, by `zerotune finetune` on one machine (2 CPU processes: the same world size),
    on data prepared by `zerotune data` rather than this cluster's prepare job: the same fingerprint, or the
    comparison would compare different data."""
    fp = [json.loads((d / "data" / "manifest.json").read_text())["fingerprint"] for d in (prepared, tiny_reference_10)]
    assert fp[0] == fp[1], fp
    return tiny_reference_10


@pytest.fixture(scope="module")
def requeued(slurm, prepared) -> tuple[Path, str, dict]:
    """The 2-node run stopped by a time-limit warning mid-run, requeued and finished: (run folder, job, its info)."""
    run = prepared
    job = finetune(slurm, run)
    wait_until(lambda: last_step(run) >= 3, "step 3")
    slurm.run("scancel", "--signal=USR1", "--batch", job)  # what SLURM's --signal=B:USR1@900 does
    return run, job, slurm.wait_final(job, restarts=1)


def test_time_limit_warning_commits_requeues_resumes_and_quantizes(slurm, requeued, reference):
    run, job, info = requeued
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    first, second = log.split("finetune: job {} attempt 2".format(job))
    assert "finetune: SIGUSR1 (time-limit warning)" in first
    assert first.count("SIGUSR1 -> worker pid") == 2, "one worker on each node, signalled by pid"
    step = int(re.search(r"finetune: SIGUSR1 received: checkpointing at step (\d+) and stopping", first).group(1))
    assert 3 <= step < STEPS
    ckpt = run / "checkpoints" / f"checkpoint-{step}"  # rotated away by the end: the log is the record
    assert f"checkpoint: committed checkpoint-{step}" in first
    assert (f"finetune: stopped by SIGUSR1 at step {step}: checkpoint committed ({ckpt}); requeueing job {job}"
            in first)
    assert "Traceback" not in log
    assert f"finetune: resuming from committed checkpoint {ckpt}" in second
    assert second.rstrip().endswith(f"finetune: finished: model published in {run / 'model'}")
    assert_matches_reference(reference, run)

    q = slurm.sbatch("--mem=4G", "slurm/quantize.sbatch", "tiny", f"output_dir={run}")
    info = slurm.wait_final(q)
    assert info["JobState"] == "COMPLETED", slurm.log_tail(q, "zerotune-quantize")
    assert (run / "gguf" / "tiny-q8_0.gguf").stat().st_size > 0


@pytest.mark.extended  # 270 s; the requeue itself is CI's time-limit test below
def test_usr1_at_startup_then_scancel_then_resubmit(slurm, prepared, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(prepared / "data", run / "data")
    job = finetune(slurm, run)
    pids = run / "train" / "pids" / f"job{job}"
    # the first worker has its handler: it is loading the model, initialising DeepSpeed, nowhere near a step
    wait_until(lambda: pids.exists() and any(pids.glob("*.pid")), "a registered worker", interval=0.1)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    wait_until(lambda: "attempt 2" in slurm.log(job), "the requeued attempt")
    first = slurm.log(job).split(f"finetune: job {job} attempt 2")[0]
    assert last_step(run) == 0 and not list(run.glob("checkpoints/checkpoint-*")), "stopped before training"
    assert "Traceback" not in first, first[-4000:]
    assert not re.search(r"checkpoint committed|committed checkpoint|checkpoint: committed", first), first[-4000:]
    assert "finetune: SIGUSR1 received before the first step: stopping without a new checkpoint" in first
    assert (f"finetune: stopped by SIGUSR1 before training started: no new checkpoint; requeueing job {job}, "
            "which starts from the beginning") in first

    # The requeued attempt trains; scancel it mid-run (SIGTERM to every process, then SIGKILL).
    wait_until(lambda: (run / "checkpoints" / "checkpoint-2" / "zerotune_commit.json").exists() and last_step(run) >= 3,
               "checkpoint-2 committed and step 3")
    slurm.run("scancel", job)
    info = slurm.wait_final(job, restarts=1)
    assert info["JobState"] == "CANCELLED", info
    wait_until(lambda: not _alive(pids), "the workers to exit")
    from zerotune.checkpoint import last_committed

    resume = last_committed(run / "checkpoints", quiet=True)
    assert resume is not None and 2 <= int(resume.name.split("-")[1]) < STEPS

    again = finetune(slurm, run)  # the same command, by hand
    info = slurm.wait_final(again)
    log = slurm.log(again)
    assert info["JobState"] == "COMPLETED", log[-4000:]
    assert f"finetune: resuming from committed checkpoint {resume}" in log
    assert_matches_reference(reference, run)


@pytest.mark.extended  # 57 s; the same conversion and resume, 2 -> 1 -> 2 processes, is CI's test_resume.py test
def test_two_node_checkpoint_resumes_on_one_node(slurm, requeued, reference, tmp_path):
    """A job that got 1 node instead of 2: its preflight converts the 2-node checkpoint for 1 x 1 process."""
    src = requeued[0]
    run = tmp_path / "run"
    shutil.copytree(src / "data", run / "data")
    shutil.copytree(src / "checkpoints" / "checkpoint-8", run / "checkpoints" / "checkpoint-8")  # by nodes n1 and n2
    (run / "train").mkdir()
    (run / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics(src) if r["step"] <= 8))
    job = slurm.sbatch("--nodes=1", "--time=30", "slurm/finetune.sbatch", "tiny", f"output_dir={run}", *COMMON,
                       "train.cpu_procs=1")
    info = slurm.wait_final(job)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    ckpt = run / "checkpoints" / "checkpoint-8"
    assert (f"finetune: checkpoint-8 was written by 2 processes and this run has 1: converting it once to "
            f"DeepSpeed's universal format in {ckpt / 'universal'}") in log
    assert f"finetune: resuming from committed checkpoint {ckpt}" in log and "world size 2 -> 1" in log
    assert "universal load checked" in log and "Traceback" not in log
    assert log.rstrip().endswith(f"finetune: finished: model published in {run / 'model'}")
    a, b = metrics(reference), metrics(run)
    assert [r["step"] for r in b if "loss" in r] == list(range(1, STEPS + 1))
    for x, y in zip(a, (r for r in b if "loss" in r)):
        assert y["loss"] == pytest.approx(x["loss"], abs=5e-6), (x, y)  # test_resume.py's LOSS_ABS, and why


def test_usr1_while_converting_stops_at_once_and_requeues(slurm, prepared, reference, tmp_path):
    """A 2-process checkpoint resubmitted on 1 node: the preflight converts it, slowed down by a fault hook as an 8B
    conversion takes ~27 min. The time-limit warning during it is handled at once: the conversion stops, nothing
    half-built is left, the checkpoint is as it was, the job is requeued. The run folder's name has glob and regex
    characters, which DeepSpeed's converter reads unescaped: its part of the conversion ran before the warning."""
    run = tmp_path / "run (copy)+[1]"
    shutil.copytree(prepared / "data", run / "data")
    ckpt = run / "checkpoints" / "checkpoint-8"
    shutil.copytree(reference / "checkpoints" / "checkpoint-8", ckpt)  # written by 2 processes

    def files():
        return {str(f.relative_to(ckpt)): (f.stat().st_size, f.stat().st_mtime_ns) for f in ckpt.rglob("*")}

    original = files()
    job = slurm.sbatch("--nodes=1", "--time=30", "--export=ALL,ZEROTUNE_FAULT_SLOW_CONVERSION=600",
                       "slurm/finetune.sbatch", "tiny", f"output_dir={run}", *COMMON, "train.cpu_procs=1")
    wait_until(lambda: "faults: ZEROTUNE_FAULT_SLOW_CONVERSION=600" in slurm.log(job), "the conversion", timeout=300)
    assert (ckpt / "universal.tmp" / "global_step8" / "zero").is_dir(), "DeepSpeed's part, through the alias"
    t0 = time.time()
    slurm.run("scancel", "--signal=USR1", "--batch", job)  # what SLURM's --signal=B:USR1@900 does
    wait_until(lambda: int(slurm.job(job)["Restarts"]) >= 1, "the requeue", timeout=120)
    took = time.time() - t0
    slurm.run("scancel", job)  # the requeued attempt would convert again: nothing more to see here
    log = slurm.log(job)
    assert took < 30, f"the stop took {took:.0f} s: {log[-3000:]}"
    assert "finetune: SIGUSR1 (time-limit warning) during the preflight: stopping it" in log, log[-3000:]
    assert re.search(r"finetune: stopped by SIGUSR1 during the preflight, \d+ s into converting checkpoint-8 to "
                     r"DeepSpeed's universal format \(estimated ~\d+ s\): the half-built conversion was removed and "
                     rf"checkpoint-8 is intact; requeueing job {job}, which runs the preflight again", log), log[-3000:]
    assert "Traceback" not in log and "asking the workers" not in log
    assert not (ckpt / "universal.tmp").exists() and not (ckpt / "universal").exists()
    assert files() == original, "the checkpoint as it was"
    assert json.loads((run / "train" / "stopped_before_training.json").read_text()) == {"job": job}


def _alive(pids: Path) -> bool:
    return any(Path(f"/proc/{f.read_text().strip()}").exists() for f in pids.glob("*.pid"))


def test_deadline_stops_at_a_step_boundary_with_a_commit(prepared, tmp_path):
    """ZEROTUNE_DEADLINE already passed: no time for another step, so the workers commit after step 1 and exit 75."""
    run = tmp_path / "run"
    shutil.copytree(prepared / "data", run / "data")
    env = {**os.environ, "ZEROTUNE_DEADLINE": str(int(time.time()))}
    p = subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny", f"output_dir={run}", *COMMON,
                        "train.cpu_procs=2"], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    log = p.stdout + p.stderr
    assert p.returncode == 75, log[-3000:]
    assert "checkpointing at step 1 and stopping" in log
    stopped = json.loads((run / "train" / "stopped.json").read_text())
    assert stopped == {"step": 1, "signal": "deadline", "checkpoint": str(run / "checkpoints" / "checkpoint-1"),
                       "committed": True}
    assert "finetune: stopped on deadline at step 1 with committed checkpoint" in log
