"""What the processes of one training run hand each other, as types: written once, read once.

    workers (rank 0) -> finalize   Probe      model.tmp/zerotune_probe.pt   the reference logits to verify the save
    workers (rank 0) -> finalize   RunRecord  train/run.json                world size, device, batch, steps, time
    workers (rank 0) -> launcher   StopRecord train/stopped.json            stopped early: at which step, why,
                        and sbatch                                          whether a checkpoint was committed
    workers -> launcher            hand_off   train/error*.json             a worker's user error (read by
                                                                            errors.read_handoff)

A committed checkpoint carries its own record, written by rank 0 and read by the next attempt: checkpoint.py's
CommitMarker (checkpoint-N/zerotune_commit.json), and reshard.py's Conversion for its conversion to another world
size.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import manifest as mf
from ..errors import EXIT_CODE, HANDOFF, debug, read_handoff, report

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
class StopRecord(_JsonFile):
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
    stopped: StopRecord | None  # stopped early on a signal or the deadline: run again to resume
    user_error: dict | None  # a worker's user error (errors.hand_off), printed by local rank 0 unless "printed" is False

    @classmethod
    def read(cls, run, rc: int) -> Outcome:
        stopped = StopRecord.read(run.stopped) if rc != 0 else None
        return cls(rc, stopped, read_handoff(run.train) if rc != 0 and not stopped else None)


def hand_off(train_dir: Path, e: BaseException) -> int:
    """A worker's user error: local rank 0 prints it and writes the handoff; other ranks only write theirs
    (errors.read_handoff reads them back)."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    name = HANDOFF if local == 0 else f"error.rank{os.environ.get('RANK', local)}.json"
    if local == 0:  # printed before the handoff says so: torchrun may stop this rank once another has exited
        report(e)
    mf.write_atomic(Path(train_dir) / name, json.dumps({"message": str(e), "type": type(e).__name__,
                                                        "rank": os.environ.get("RANK"), "printed": local == 0}))
    if local == 0:
        return EXIT_CODE
    if debug():
        traceback.print_exception(e)
    return EXIT_CODE
