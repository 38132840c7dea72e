"""Runs that survive (real ZeRO-3, 2 CPU processes): SIGUSR1, kill -9, a full disk, a truncated checkpoint
and a NaN loss each leave a committed checkpoint, and the resumed run's losses equal an uninterrupted run's; a
checkpoint resumed on another number of processes (2 -> 1 -> 2) too, within a stated tolerance."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, start_train, wait_for_step, workers_of, zt
from conftest import RESUME_COMMON as COMMON
from conftest import RESUME_STEPS as STEPS
from conftest import read_metrics as metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference(tiny_reference_10):
    return tiny_reference_10  # conftest: shared with the SLURM tests


def fresh(reference: Path, out: Path, *parts: str) -> Path:
    """A new run folder with the reference's prepared data and base model (same fingerprints)."""
    for part in ("data", "base", *parts):
        shutil.copytree(reference / part, out / part)
    return out


def assert_matches_reference(reference: Path, out: Path) -> None:
    a, b = metrics(reference), metrics(out)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), "every step exactly once"
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6), (x, y)


def test_rotation_keeps_the_newest_committed_checkpoints(reference):
    from zerotune.checkpoint import problem

    kept = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert kept == ["checkpoint-10", "checkpoint-8"]
    assert all(problem(reference / "checkpoints" / k) is None for k in kept)


def test_planned_checkpoint_size_matches_the_real_one(reference):
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan

    disk = compute_plan(load_recipe("tiny", [f"output_dir={reference}", *COMMON])).disk
    real = sum(f.stat().st_size for f in (reference / "checkpoints" / "checkpoint-10").rglob("*") if f.is_file())
    assert abs(real - disk.checkpoint_bytes) / real < 0.02, (real, disk)
    assert disk.checkpoints_at_once == 3  # save_total_limit 2 + the one being committed


@pytest.mark.extended  # the same stop, commit and exact resume run in CI through sbatch (test_slurm_cluster.py)
def test_sigusr1_checkpoints_and_resume_matches_uninterrupted_run(reference, tmp_path):
    run = fresh(reference, tmp_path / "run")
    proc = start_train(run, tmp_path / "interrupted.log", *COMMON)
    wait_for_step(proc, run, 3)
    # What slurm/finetune.sbatch's trap does: USR1 to the workers (torchrun's children), not to torchrun.
    subprocess.run(["pkill", "-USR1", "-f", workers_of(run)], check=True)
    proc.wait(timeout=600)
    log = (tmp_path / "interrupted.log").read_text()
    assert proc.returncode == 75, log[-3000:]
    assert "SIGUSR1 received: checkpointing at step" in log
    stopped = json.loads((run / "train" / "stopped.json").read_text())
    assert 3 <= stopped["step"] < STEPS and stopped["signal"] == "SIGUSR1"
    assert (Path(stopped["checkpoint"]) / "zerotune_commit.json").exists()
    assert not (run / "model").exists(), "a stopped run must not publish a final model"

    resumed = zt("finetune", "tiny", f"output_dir={run}", *COMMON).stdout
    assert f"resuming from committed checkpoint {stopped['checkpoint']}" in resumed
    assert_matches_reference(reference, run)


@pytest.mark.extended  # 3 min; CI: a truncated checkpoint falls back, nothing non-finite commits (same file)
def test_kill9_then_full_disk_then_resume_matches_uninterrupted_run(reference, tmp_path):
    run = fresh(reference, tmp_path / "run")
    proc = start_train(run, tmp_path / "killed.log", *COMMON)
    wait_for_step(proc, run, 7, committed=6)
    # A node failure: every process of the job, launcher and torchrun included, dies without warning.
    subprocess.run(["pkill", "-9", "-f", f"zerotune finetune tiny output_dir={run}|zerotune.train (torchrun|worker) {run}"],
                   check=True)
    proc.wait(timeout=60)
    assert metrics(run)[-1]["step"] >= 7

    # The disk fills while the resumed run saves checkpoint-8: the kernel refuses writes past the limit.
    biggest = max(f.stat().st_size for f in (run / "checkpoints" / "checkpoint-6").rglob("*") if f.is_file())
    limit = biggest - 1

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny", f"output_dir={run}", *COMMON],
                          cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=small_disk)
    log = full.stdout + full.stderr
    assert full.returncode != 0, log[-3000:]
    assert "writing checkpoint-8 failed" in log and "not committed" in log, log[-3000:]
    assert f"last committed checkpoint: {run / 'checkpoints' / 'checkpoint-6'} (intact" in log, log[-3000:]
    assert not (run / "checkpoints" / "checkpoint-8" / "zerotune_commit.json").exists()
    assert not (run / "model").exists()

    resumed = zt("finetune", "tiny", f"output_dir={run}", *COMMON).stdout
    assert "skipping checkpoint-8: never committed" in resumed
    assert f"resuming from committed checkpoint {run / 'checkpoints' / 'checkpoint-6'}" in resumed
    assert "rows logged after step 6 by the interrupted attempt" in resumed
    assert_matches_reference(reference, run)
    assert (run / "model" / "model.safetensors").exists()


def test_truncated_checkpoint_falls_back_to_the_previous_one(reference, tmp_path):
    run = fresh(reference, tmp_path / "run", "checkpoints")
    shutil.copy(reference / "train" / "metrics.jsonl", tmp_path / "metrics.jsonl")
    (run / "train").mkdir()
    shutil.copy(tmp_path / "metrics.jsonl", run / "train" / "metrics.jsonl")
    victim = max((f for f in (run / "checkpoints" / "checkpoint-10").rglob("*") if f.is_file()),
                 key=lambda f: f.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)

    resumed = zt("finetune", "tiny", f"output_dir={run}", *COMMON).stdout
    rel = victim.relative_to(run / "checkpoints" / "checkpoint-10")
    assert f"skipping checkpoint-10: {rel} is" in resumed and "truncated" in resumed
    assert f"resuming from committed checkpoint {run / 'checkpoints' / 'checkpoint-8'}" in resumed
    assert_matches_reference(reference, run)


# Resume at another world size (reshard.py). Tolerances, from runs of this recipe: at 1 process an uninterrupted
# run's losses equal the 2-process reference's within one fp32 ulp (9.5e-7 at a loss of ~8) for all 10 steps and its
# grad norms within 5e-8 relative; its Adam moments at step 10 within 4e-7 of their norm. Another world size only
# regroups the sums of gradient contributions (grad-accum micro-batches per rank, then the reduce-scatter over
# ranks). A resume that carried a state over wrongly is far outside: DeepSpeed's universal load shares one Adam step
# tensor between sub-groups (stage3.py:3681), which gave 6.9e-5 on the loss of step 10, 1.8e-5 on its grad norm and
# 3.8e-5 on the moments before train/reshard_load.CheckUniversalLoad gave each sub-group its own.
LOSS_ABS = 5e-6  # 5 ulp
GRAD_NORM_REL = 1e-6
MOMENTS_REL = 1e-6


def _digest(folder: Path, skip: str) -> dict[str, str]:
    """sha256 of every file under `folder` but those under `skip`: what the original checkpoint must keep."""
    import hashlib

    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file() and not f.relative_to(folder).parts[0].startswith(skip)}


def _gather(step_dir: Path) -> dict[str, dict]:
    """Every parameter's fp32 weights and Adam m, v, whole, from a ZeRO-3 checkpoint's per-rank shards: rank r holds
    elements [r * ceil(n / W), ...) of each parameter, parameters in the order of the model states' param_shapes,
    zero-padded at the end (as the universal loader cuts them: deepspeed runtime/zero/stage3.py:3793-3802)."""
    import math
    import re

    import torch

    def by_rank(pattern):
        return sorted(step_dir.glob(pattern), key=lambda f: int(re.search(r"rank_(\d+)_", f.name).group(1)))

    shards = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
              for f in by_rank("*zero_pp_rank_*_optim_states.pt")]
    shapes = torch.load(by_rank("*zero_pp_rank_*_model_states.pt")[0], map_location="cpu",
                        weights_only=False)["param_shapes"]
    out = {}
    for g, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            n = math.prod(shape)
            part = math.ceil(n / len(shards))
            flats = {"fp32": [sd["fp32_flat_groups"][g] for sd in shards],
                     **{s: [sd["optimizer_state_dict"]["state"][g][s] for sd in shards] for s in ("exp_avg", "exp_avg_sq")}}
            out[name] = {s: torch.cat([f.narrow(0, offset, part) for f in fs])[:n] for s, fs in flats.items()}
            offset += part
    return out


@pytest.mark.extended  # 2.5 min; CI: DPO's 1 -> 2 processes through the same conversion (test_preference.py)
def test_resume_on_one_then_two_processes_matches_uninterrupted_run(reference, tmp_path):
    """2 ranks -> 1 -> 2 through the CLI: the reference's checkpoint-8 (2 ranks) is resumed on 1 process, which a
    passed deadline stops after step 9 with checkpoint-9 committed at world size 1; that is resumed on 2 processes
    for step 10. Before it, a kill while converting."""
    import time

    import torch

    run = fresh(reference, tmp_path / "run")
    ckpt = run / "checkpoints" / "checkpoint-8"
    shutil.copytree(reference / "checkpoints" / "checkpoint-8", ckpt)
    (run / "train").mkdir()
    (run / "train" / "metrics.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in metrics(reference) if r["step"] <= 8))
    original = _digest(ckpt, "universal")

    def finetune(procs: int, **env):
        return subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny", f"output_dir={run}", *COMMON,
                               f"train.cpu_procs={procs}"], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env})

    # A node failure while the launcher converts: the original as it was, the half-built folder left behind
    killed = finetune(1, ZEROTUNE_FAULT_KILL_WHILE_CONVERTING="1")
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (ckpt / "universal.tmp").is_dir() and not (ckpt / "universal").exists()
    assert _digest(ckpt, "universal") == original

    # 2 -> 1, stopped after its first step by a deadline already passed
    one = finetune(1, ZEROTUNE_DEADLINE=str(int(time.time())))
    log = one.stdout + one.stderr
    assert one.returncode == 75, log[-3000:]
    assert "removed a half-built universal conversion of checkpoint-8" in log
    assert (f"checkpoint-8 was written by 2 processes and this run has 1: converting it once to DeepSpeed's "
            f"universal format in {ckpt / 'universal'}") in log
    assert "world size 2 -> 1" in log and "grad-accum 2 -> 4" in log
    assert "universal load checked: fp32 weights, Adam m and v of 21 tensors" in log and "on 1 process; Adam step 8" in log
    assert "checkpointing at step 9 and stopping" in log and "Traceback" not in log
    assert not (ckpt / "universal.tmp").exists()
    assert _digest(ckpt, "universal") == original, "the original checkpoint is only read"
    from zerotune.checkpoint import saved_world_size

    assert saved_world_size(run / "checkpoints" / "checkpoint-9") == 1
    # The conversion holds exactly the original's fp32 weights and Adam moments, gathered from both ranks' shards
    before = _gather(ckpt / "global_step8")
    zero = ckpt / "universal" / "global_step8" / "zero"
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(before)
    for name, states in before.items():
        for s, t in states.items():
            assert torch.equal(torch.load(zero / name / f"{s}.pt", weights_only=False).view(-1), t), (name, s)

    # 1 -> 2
    two = finetune(2)
    log = two.stdout + two.stderr
    assert two.returncode == 0, log[-3000:]
    assert "checkpoint-9 was written by 1 process and this run has 2: converting" in log
    assert "grad-accum 4 -> 2" in log and "on 2 processes; Adam step 9" in log
    assert "Traceback" not in log

    a, b = metrics(reference), metrics(run)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), "every step exactly once"
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=LOSS_ABS), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=GRAD_NORM_REL), (x, y)
    # ... and so do the Adam moments and weights two resumed steps later
    ref10, got10 = _gather(reference / "checkpoints" / "checkpoint-10" / "global_step10"), \
        _gather(run / "checkpoints" / "checkpoint-10" / "global_step10")
    for name, states in ref10.items():
        for s, t in states.items():
            assert (got10[name][s] - t).norm() <= MOMENTS_REL * t.norm(), (name, s)


def test_resume_at_a_world_size_that_cannot_keep_the_batch_fails_before_converting(reference, tmp_path):
    run = fresh(reference, tmp_path / "run", "checkpoints")  # written by 2 ZeRO-3 ranks: 4 sequences per step
    before = sorted(str(p.relative_to(run)) for p in (run / "checkpoints").rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny", f"output_dir={run}", *COMMON,
                           "train.cpu_procs=3"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    ckpt = run / "checkpoints" / "checkpoint-10"
    assert (f"zerotune: {ckpt} was written by 2 processes with a global batch of 1,024 tokens (4 micro-batches of "
            "1 x 256 tokens); 3 processes cannot split it evenly, so gradient accumulation cannot keep it. Resume "
            "with a process count that divides 4: 2 or 4") in proc.stderr
    assert proc.stderr.count("zerotune: ") == 1 and "Traceback" not in proc.stderr  # one message
    assert "converting" not in proc.stdout and not (run / "train" / "metrics.jsonl").exists()
    assert sorted(str(p.relative_to(run)) for p in (run / "checkpoints").rglob("*")) == before


def _nan_run(reference: Path, out: Path, fault: str, step: int, *extra: str) -> str:
    run = fresh(reference, out)
    env = {**os.environ, fault: str(step)}
    proc = subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny", f"output_dir={run}", *COMMON, *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode not in (0, 75), proc.stdout[-2000:]
    assert not (run / "model").exists()
    return proc.stdout + proc.stderr


def _finite(ckpt: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(str(ckpt / "model.safetensors")).values())


def test_nan_loss_stops_with_the_last_checkpoint_intact(reference, tmp_path):
    log = _nan_run(reference, tmp_path / "run", "ZEROTUNE_FAULT_NAN_LOSS_STEP", 5)
    assert "NonFiniteLossError: loss is nan at step 5" in log, log[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-4"
    assert f"last committed checkpoint: {ckpt} (intact" in log
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert _finite(ckpt)


def test_non_finite_weights_are_never_committed(reference, tmp_path):
    # A NaN lands in rank 0's weight shard after the update of step 4, just before its save: nothing but the
    # commit check stands between it and a checkpoint.
    log = _nan_run(reference, tmp_path / "run", "ZEROTUNE_FAULT_NAN_WEIGHT_STEP", 4)
    ckpts = tmp_path / "run" / "checkpoints"
    assert "NonFiniteWeightsError" in log and "checkpoint-4 holds non-finite" in log, log[-3000:]
    assert f"last committed checkpoint: {ckpts / 'checkpoint-2'} (intact" in log
    assert not (ckpts / "checkpoint-4" / "zerotune_commit.json").exists()
    assert _finite(ckpts / "checkpoint-2")


def test_rotation_and_validation_rules(tmp_path, capsys):
    from zerotune.checkpoint import MARKER, file_sizes, last_committed, rotate

    root = tmp_path / "checkpoints"

    def make(step, commit):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(b"x" * 10)
        if commit:
            (d / MARKER).write_text(json.dumps({"step": step, "files": file_sizes(d)}))
        return d

    make(2, True), make(4, True), make(6, False), make(8, True)
    (root / "checkpoint-8" / "weights.bin").write_bytes(b"x" * 5)
    assert last_committed(root) == root / "checkpoint-4"
    assert "skipping checkpoint-8: weights.bin is 5 bytes but was committed with 10" in capsys.readouterr().out
    # keep=1 after committing 8: older committed and stale uncommitted go, the newest committed stays
    assert rotate(root, 1) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [p.name for p in root.iterdir()] == ["checkpoint-8"]
    assert rotate(root, 1) == []


def test_metrics_rewind_moves_rows_after_the_resume_point(tmp_path):
    from zerotune.metrics import StepMetrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)))
    StepMetrics(path, 1, 1.0, 1.0, None, 1).rewind(4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    moved = (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in moved] == [5, 6, 7]


@pytest.mark.extended
def test_sequence_parallel_2_resumed_at_1_matches_the_uninterrupted_run_and_passes_check(reference, tmp_path):
    """Issue 52: the reference's batch trained at train.sequence_parallel=2 (both ranks share each row: data-parallel
    1, grad-accum 4), stopped after its first step by a deadline already passed (committed at step 1), resumed at 1
    (data-parallel 2, grad-accum 2) on the same 2 ranks: nothing to convert (ZeRO-3 partitions by world size, not
    by N), every loss equal to the uninterrupted run's, then finalize, quantize and a passing GGUF check."""
    import time

    run = fresh(reference, tmp_path / "run")
    sp2 = subprocess.run([sys.executable, "-m", "zerotune", "finetune", "tiny", f"output_dir={run}", *COMMON,
                          "train.sequence_parallel=2"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "ZEROTUNE_DEADLINE": str(int(time.time()))})
    log = sp2.stdout + sp2.stderr
    assert sp2.returncode == 75, log[-3000:]
    assert "data-parallel 1 (world 2 / sequence-parallel 2) x grad-accum 4" in log, log[-3000:]
    assert "checkpointing at step 1 and stopping" in log and "Traceback" not in log

    one = zt("finetune", "tiny", f"output_dir={run}", *COMMON).stdout
    assert "resuming from committed checkpoint" in one and "checkpoint-1" in one
    assert "converting" not in one and "x world 2 x grad-accum 2" in one
    assert_matches_reference(reference, run)

    zt("quantize", "tiny", f"output_dir={run}")
    checked = zt("check", "tiny", f"output_dir={run}")  # exits 0 only when the GGUF passes its gates
    assert (run / "check" / "check.json").exists(), checked.stdout[-2000:]
