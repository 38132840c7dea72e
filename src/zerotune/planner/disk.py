"""Disk under output_dir, per event of a run, counting what the run already holds.

A requeued or rerun job already has committed checkpoints on disk: they are this run's own bytes, not a
demand on the free space. What the file system must still offer is, at the run's worst event, the bytes the
run will have then minus the bytes it has now (those it keeps are already counted as used; those it removes
first come back as free space). The events, in the order a run meets them:

  save           a checkpoint is written while the committed ones are held: train/callbacks.py CommitCheckpoints
                 rotates (deletes the oldest) only after the new one is committed (checkpoint.py:164-167),
                 so with k held it needs one more checkpoint of room
  save at limit  the same with train.save_total_limit checkpoints held: the most checkpoints at once
  finalize       train/worker.py save_for_finalize writes model.tmp/ beside the committed checkpoints (it
                 removes an earlier model.tmp/ first, :243); finalize publishes it as model/ (manifest.publish keeps
                 the old model/ until the new one is in place; an old model/ is held now, so it needs nothing);
                 PEFT: model.tmp/ holds the adapter and finalize stages the merged model as model.merged.tmp/

Only committed checkpoints (checkpoint.committed: zerotune_commit.json present) count as held: a partial
folder newer than the resume point is removed at start (checkpoint.discard_after) and an older one at the
next commit, so counting neither asks for a little more room than strictly needed, never less.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..checkpoint import committed, step_of


def tree_bytes(p: Path) -> int:
    """Bytes of the files under p (apparent size: what a checkpoint's files will take on a full disk)."""
    p = Path(p)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def held(checkpoints: Path, model_staging: Path) -> dict:
    """What the run already holds that the events below replace: committed checkpoints and a stale model.tmp/."""
    good = committed(checkpoints)
    return {"checkpoints": len(good), "checkpoint_steps": [step_of(p) for p in good],
            "checkpoint_bytes": sum(tree_bytes(p) for p in good), "model_staging_bytes": tree_bytes(model_staging)}


def _events(k: int, saves: int | None, K: int, C: int, staging: int) -> list[dict]:
    """Bytes at each event for a run that holds k committed checkpoints and has `saves` saves to come
    (None: unknown, before `prepare`); K = save_total_limit (<= 0: no limit)."""
    def cap(n: int) -> int:
        return min(n, K) if K > 0 else n

    first = cap(k)  # held while the next checkpoint is written
    if saves is not None:
        last, end = cap(k + saves - 1), cap(k + saves)
    else:  # as many saves as it takes to reach the limit; no limit and unknown length: only the next is known
        last, end = (K, K) if K > 0 else (first, first + 1)
    rows = [{"event": "save" if k else "first save", "checkpoints_held": first, "bytes": (first + 1) * C}]
    if last > first:
        rows.append({"event": "save at save_total_limit" if K > 0 and last == K else "last save",
                     "checkpoints_held": last, "bytes": (last + 1) * C})
    rows.append({"event": "finalize staging", "checkpoints_held": end, "bytes": end * C + staging})
    return rows


def disk_events(*, checkpoint_bytes: int, model_bytes: int, adapter_bytes: int | None, save_total_limit: int,
                save_steps: int, total_steps: int | None, now: dict) -> dict:
    """Per-event disk need. checkpoint_bytes / model_bytes: planned sizes of one checkpoint and of the 16-bit
    model; adapter_bytes: the adapter when PEFT (None: full fine-tuning); now: held(...) for this run.

    Returns a fresh run's bytes at each event (`events`) and its worst (`peak_bytes`: the most this run ever
    has under output_dir), and, for the run as it stands (`events_now`), what the file system must still
    offer at each event: the bytes then less what the run holds now (`needed_free_bytes`: the worst, at
    `needed_at`). A stale model.tmp/ is held through the saves and removed before finalize stages a new one."""
    C, K, k = checkpoint_bytes, save_total_limit, now["checkpoints"]
    resumed_at = max(now["checkpoint_steps"], default=0)

    def saves_from(step: int) -> int | None:
        if save_steps <= 0:
            return 1  # only the checkpoint a signal or the deadline asks for
        if total_steps is None:
            return None
        return max(1, math.ceil(max(0, total_steps - step) / save_steps))

    staging = model_bytes + adapter_bytes if adapter_bytes is not None else model_bytes
    events = _events(0, saves_from(0), K, C, staging)
    now_rows = []
    for e in _events(k, saves_from(resumed_at), K, C, staging):
        freed = now["checkpoint_bytes"] + (now["model_staging_bytes"] if e["event"] == "finalize staging" else 0)
        now_rows.append({**e, "needed_free_bytes": max(0, e["bytes"] - freed)})
    worst = max(now_rows, key=lambda e: e["needed_free_bytes"])
    return {"events": events, "peak_bytes": max(e["bytes"] for e in events),
            "checkpoints_at_once": max(e["checkpoints_held"] + 1 for e in events if "save" in e["event"]),
            "held": now, "events_now": now_rows,
            "needed_free_bytes": worst["needed_free_bytes"], "needed_at": worst["event"]}


# Checkpoint bytes reshard.build_conversion turns into DeepSpeed's universal format per second, in one process (DeepSpeed's
# extraction and merge, then zerotune's checksums): 198 MB in 3.3 s, the tiny model's checkpoint on a 2-core VM
# (tests/test_resume.py's run). A measurement at tiny scale, scaled linearly: an estimate, not a promise.
CONVERT_BYTES_PER_S = 6e7


def world_size_change(trainable_params: int, world: int, gpus_per_node: int) -> dict:
    """What resuming a ZeRO-3 checkpoint written by `world` ranks at another world size costs (reshard.py).
    The conversion holds fp32 weights and Adam m and v of every trainable parameter (4 B each, one file per
    parameter and state); DeepSpeed's converter writes all fragments, then the merged files and a copy of rank 0's
    shard, before it removes the fragments (ds_to_universal.py:1318-1353): twice that, plus a shard, at its peak.
    At load every rank reads each parameter's files whole and keeps its own partition (stage3.py:3770-3802): a
    node's ranks read the conversion gpus_per_node times (once from storage when the page cache holds it)."""
    u = 12 * trainable_params
    return {"bytes": u, "peak_bytes": 2 * u + u // max(1, world), "convert_s": u / CONVERT_BYTES_PER_S,
            "load_read_bytes_per_node": gpus_per_node * u}
