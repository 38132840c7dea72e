"""What the processes of one training run hand each other, as types: written once, read once.

    workers (rank 0) -> finalize   Probe      model.tmp/zerotune_probe.pt   the reference logits to verify the save
    workers (rank 0) -> finalize   RunRecord  train/run.json                world size, device, batch, steps, time
    workers (rank 0) -> launcher   Stopped    train/stopped.json            stopped early: at which step, why,
                        and sbatch                                          whether a checkpoint was committed

A user error on a worker travels by errors.py's own handoff (train/error*.json). A committed checkpoint carries
its own record, written by rank 0 and read by the next attempt: checkpoint.py's CommitMarker
(checkpoint-N/zerotune_commit.json), and universal.py's Conversion for its world-size conversion.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .. import manifest as mf

PROBE_FILE = "zerotune_probe.pt"


@dataclass
class Probe:
    """The trained model's logits on a short prefix of one training row (verify.py), kept to check the save."""
    probe: dict  # input_ids, position_ids (packed) or attention_mask: CPU tensors of PROBE_TOKENS positions
    logits: object  # torch.Tensor, in the training dtype
    n_params: int
    precision: str
    trainable_params: int | None = None  # PEFT runs only
    attention: str = "sdpa"  # the attn_implementation training ran: verify's reload runs the same kernel

    def save(self, folder: Path) -> None:
        import torch

        torch.save(asdict(self), Path(folder) / PROBE_FILE)

    @classmethod
    def load(cls, folder: Path) -> Probe:
        import torch

        return cls(**torch.load(Path(folder) / PROBE_FILE))

    @staticmethod
    def discard(folder: Path) -> None:
        (Path(folder) / PROBE_FILE).unlink(missing_ok=True)


class _JsonFile:
    """A dataclass written as one JSON file (atomically) and read back as the same type; None when absent."""

    def write(self, path: Path) -> None:
        mf.write(path, asdict(self))

    @classmethod
    def read(cls, path: Path):
        d = mf.read(path)
        return cls(**d) if d else None


@dataclass
class RunRecord(_JsonFile):
    """How the run trained; finalize copies it into train/manifest.json."""
    world_size: int
    device: str
    data_fingerprint: str
    choice: dict  # precision, attention, liger
    batch: dict  # global_batch_tokens, seq_len, micro_batch_size, grad_accum
    steps: int
    elapsed_s: float
    base: str


@dataclass
class Stopped(_JsonFile):
    """The workers stopped before the last step: a signal or the job's deadline (committed=True: a checkpoint
    was committed at `step`), or a signal before the first step (committed=False: nothing new saved)."""
    step: int
    signal: str
    checkpoint: str | None
    committed: bool


@dataclass
class Outcome:
    """How the workers ended, read from the run folder by whoever started them: `zerotune finetune` (launch.py)
    and slurm/finetune.sbatch (slurm/job.py) read it the same way and each says it in its own words (only
    sbatch requeues)."""
    rc: int
    stopped: Stopped | None  # stopped early on a signal or the deadline: run again to resume
    user_error: dict | None  # a worker's user error (errors.hand_off), printed by local rank 0 unless "printed" is False

    @classmethod
    def read(cls, run, rc: int) -> Outcome:
        from ..errors import read_handoff

        stopped = Stopped.read(run.stopped) if rc != 0 else None
        return cls(rc, stopped, read_handoff(run.train) if rc != 0 and not stopped else None)
