"""A real two-node SLURM cluster on this machine (scripts/slurm_local_cluster.sh) and helpers to drive it.

Imported by tests/test_slurm_cluster.py; the `slurm` fixture is session-scoped there. It installs nothing:
.ci/run installs slurm-wlm and munge. Without root or SLURM it skips, except under CI (CI=1), where that is
a failure.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_local_cluster.sh"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (SlurmUser=root)"
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install -y slurm-wlm munge)"
    return None


def _free_base_port() -> int:
    """Three consecutive free ports: slurmctld, node n1, node n2."""
    for _ in range(100):
        base = random.randint(20000, 40000)
        try:
            for p in range(base, base + 3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports")


def torch_extensions_dir() -> str:
    """Where a plain `zerotune finetune` here finds DeepSpeed's JIT-built shm op: built once (~100 s), reused."""
    from torch.utils.cpp_extension import _get_build_directory

    return str(Path(_get_build_directory("deepspeed_shm_comm", verbose=False)).parent)


class Cluster:
    def __init__(self, conf: Path):
        self.dir = conf.parent
        self.logs = self.dir / "joblogs"
        self.logs.mkdir(exist_ok=True)
        self.env = {**os.environ, "SLURM_CONF": str(conf),
                    "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or torch_extensions_dir()}
        for k in [k for k in self.env if k.startswith(("SBATCH_", "SLURM_")) and k != "SLURM_CONF"]:
            del self.env[k]  # a developer's own SBATCH_ACCOUNT etc. mean nothing to this cluster

    def run(self, *cmd: str) -> str:
        p = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stdout}{p.stderr}")
        return p.stdout

    def sbatch(self, *args: str) -> str:
        """Submit; the log goes to this cluster's folder, not the repo's slurm/logs (job ids restart at 1 with
        every cluster, so logs of earlier sessions would be appended to)."""
        return self.run("sbatch", "--parsable", f"--output={self.logs}/%x-%j.out", *args).strip().split(";")[0]

    def job(self, job: str) -> dict:
        """scontrol's view of a job (kept MinJobAge = 300 s after it ends)."""
        out = self.run("scontrol", "show", "job", "-o", job)
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_final(self, job: str, restarts: int = 0, timeout: float = 900) -> dict:
        """Wait until the job has ended after `restarts` requeues."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job)
            if info["JobState"] in FINAL and int(info["Restarts"]) >= restarts:
                return info
            time.sleep(1)
        raise AssertionError(f"job {job} not finished in {timeout} s: {self.job(job)}\n{self.log_tail(job)}")

    def log(self, job: str, name: str = "zerotune-finetune") -> str:
        f = self.logs / f"{name}-{job}.out"
        return f.read_text() if f.exists() else ""

    def log_tail(self, job: str, name: str = "zerotune-finetune") -> str:
        return self.log(job, name)[-4000:]


def wait_until(predicate, what: str, timeout: float = 600, interval: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_cluster(tmp: Path):
    """Start the cluster, or skip (fail under CI) with the reason. Returns (Cluster, stop function)."""
    why = unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"SLURM cluster tests cannot run in CI: {why}")
        pytest.skip(why)
    p = subprocess.run(["bash", str(SCRIPT), "start", str(tmp), str(_free_base_port())], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError(f"{SCRIPT.name} start failed: {p.stdout}{p.stderr}")
    conf = Path(p.stdout.strip().split("=", 1)[1])

    def stop():
        subprocess.run(["bash", str(SCRIPT), "stop", str(tmp)], timeout=120)

    return Cluster(conf), stop
