"""What the ZeRO-3 measurements on CPU share (tests/test_phase_memory_zero3.py, tests/test_zero3_collectives.py): the
tiny untied Llama they train, and the launch of a test file that is its own torchrun worker on WORLD CPU ranks, as
zerotune's CPU training launches (train/launch.py: DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1, torchrun).

A helper module, not a test module: pytest collects nothing here, and the workers import it as they import conftest
(torchrun runs them from tests/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# hidden 256, 4 layers, 8/4 heads, intermediate 512, vocab 1024, untied: 2,885,888 parameters
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False)
WORLD = 2


def _run(cmd: list[str], env: dict):
    """torchrun, then the run's DeepSpeed shared-memory buffers removed, as zerotune's launcher does."""
    from zerotune.train.launch import remove_shm_buffers

    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        remove_shm_buffers("127.0.0.1", int(cmd[5].split("=")[1]))


def launch(worker: str, mode: str, out: Path) -> None:
    """torchrun `worker` (a test file that is its own worker) on WORLD CPU ranks as zerotune's CPU training is."""
    from zerotune.ports import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",  # as train/launch.py on CPU
           "LOCAL_SIZE": str(WORLD)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(worker).resolve()), mode, str(out)]
    proc = _run(cmd, env)
    if proc.returncode != 0 and "SIGABRT" in proc.stderr:
        # Once in about 13 launches while building test_phase_memory_zero3 a rank died of SIGABRT during the profiled
        # save (the profiler beside gloo's threads; cause not found). The measurement is deterministic, so a crash by
        # that signal is retried once, and said; any other failure, or a second crash, fails the test.
        import warnings

        warnings.warn(f"{mode} worker died of SIGABRT; retrying once:\n{proc.stderr[-1500:]}")
        cmd[5] = f"--master_port={free_port()}"
        proc = _run(cmd, env)
    if proc.returncode != 0:  # the workers' own lines first: torchrun's summary at the end hides why they died
        own = "\n".join(line for line in proc.stderr.splitlines()
                        if line.startswith("[rank") or "terminate" in line or "Error" in line)
        raise AssertionError(f"{mode} worker failed ({proc.returncode}):\n{own[-6000:]}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
