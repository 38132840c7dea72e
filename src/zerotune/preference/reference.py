"""The reference model's log-probabilities: computed once, before the first optimizer step, by the model being trained.

At step 0 the policy is the reference (the starting weights, e.g. an SFT run's model/), so the Trainer's own model
answers for it, sharded as it trains (ZeRO-3), in eval mode without gradients: no second model is ever loaded. TRL's
DPOTrainer does the same with `precompute_ref_log_probs`. Every rank takes its share of the micro-batches (shards
padded to equal length with a repeat of the first, whose result is dropped, because under ZeRO-3 every forward
gathers parameters with collectives), and one all-reduce assembles the table: each pair's (chosen, rejected)
log-probabilities, filled by exactly one rank, so the sum is exact.

The table covers the training pairs and the validation pairs (train/validation.py measures reward accuracy on
those). It is written to runs/<r>/reference/ (logps.pt, manifest.json) under a key of everything it depends on:
the data fingerprint (sources, tokenizer, chat template, data section), the starting weights (folder, weight files'
names, sizes and mtimes), and the numerics (precision, attention kernel, Liger). A resumed or requeued run reads it
back: by then the weights it would compute them with have trained. A resume without it, or with another key,
cannot rebuild it and says so.

Cost: one no-grad forward over every pair's two rows: about a third of an epoch's training FLOPs without recompute
(planner: the `reference` phase's memory and time).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

from .. import manifest as mf
from ..checkpoint import last_committed
from ..errors import UserError
from ..hub import local_folder, weights_fingerprint
from ..metrics import Progress, dist_if_initialized, max_over_ranks
from ..stopping import StopBeforeTraining

TABLE = "logps.pt"
FORMAT = 2  # bump when what the table holds or how it is keyed changes (2: weights by content)


def pair_logps(model, ds, collate, micro: int, device, label: str | None = None, stop=None) -> "torch.Tensor":  # noqa: F821
    """(len(ds), 2) float64: each pair's (chosen, rejected) log-probability of its completion under `model`, computed
    across all ranks (module docstring). The caller puts the model in eval mode under torch.no_grad(). label: rank 0
    shows progress under it (at 8B on one node the pass takes hours). stop: the run's StopOnSignal: a signal on any
    rank (agreed over ranks after every forward) raises StopBeforeTraining, so the job requeues instead of being
    killed inside the pass (the next attempt computes it again: the launcher refuses a job whose time cannot hold it)."""
    import torch

    d = dist_if_initialized()
    rank, world = (d.get_rank(), d.get_world_size()) if d else (0, 1)
    n = len(ds)
    table = torch.zeros(n, 2, dtype=torch.float64)
    batches = [list(range(s, min(n, s + micro))) for s in range(0, n, micro)]
    mine = batches[rank::world]
    calls = math.ceil(len(batches) / world)
    progress = Progress(calls, 0, None, label=label, unit="forward") if label and rank == 0 else None
    for k in range(calls):
        idx = mine[k] if k < len(mine) else batches[0]  # a repeat keeps this rank in the collectives; dropped
        batch = collate([ds[i] for i in idx])
        batch.pop("pair", None)
        out = model(**{key: v.to(device) for key, v in batch.items()}, pair_logps=True)["logps"]
        if k < len(mine):
            m = len(idx)
            table[idx, 0] = out[:m].double().cpu()
            table[idx, 1] = out[m:].double().cpu()
        progress.update(k + 1) if progress else None
        if stop is not None and max_over_ranks(float(stop.requested is not None), device) > 0:
            raise StopBeforeTraining(f"{stop.requested or 'a signal on another rank'} received during the reference "
                                     f"log-prob pass ({k + 1} of {calls} forwards)")
    if progress:
        progress.close()
    if d:
        table = table.to(device)
        d.all_reduce(table)
        table = table.cpu()
    return table


def cache_key(data_fingerprint: str, base: Path, choice) -> dict:
    """What the table depends on, and its digest. The weights by content (hub.weights_fingerprint), not by path or
    file times, read on rank 0 and broadcast: every rank uses the one key, and a node-local copy of the same base or
    a re-download finds the table again."""
    d = dist_if_initialized()
    got = [weights_fingerprint(Path(local_folder(str(base))))] if d is None or d.get_rank() == 0 else [None]
    if d is not None:
        d.broadcast_object_list(got, src=0)
    inputs = {"format": FORMAT, "data": data_fingerprint, "weights": got[0],
              "precision": choice.precision, "attention": choice.attention, "liger": choice.liger}
    return {"key": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16], "inputs": inputs}


class ReferencePass(TrainerCallback):
    """Fills `objective.reference` ({"train": (n, 2), "eval": (n, 2)} log-probs) at the start of training: from the
    cache when it matches, else, on a fresh start, by one pass of the model (module docstring)."""

    def __init__(self, objective, folder: Path, key: dict, checkpoints: Path, datasets: dict, micro: int, stop=None):
        self.objective = objective
        self.folder = Path(folder)
        self.key = key
        self.checkpoints = checkpoints
        self.datasets = datasets  # split -> datasets.Dataset of pair rows
        self.micro = micro
        self.stop = stop

    def on_train_begin(self, args, state, control, model=None, **kw):
        say = print if state.is_world_process_zero else (lambda *a, **k: None)
        cached = self._read()
        if max_over_ranks(float(cached is None), args.device) > 0:  # one decision for all ranks: a node-local copy may differ
            cached = None
        if cached is not None:
            self.objective.reference = cached
            say(f"finetune: reference log-probs: cache hit ({self.folder / TABLE}, key {self.key['key']}); "
                f"{sum(len(t) for t in cached.values()):,} pairs", flush=True)
            return
        resume = last_committed(self.checkpoints, quiet=True)
        if resume is not None:
            raise UserError(f"{resume} resumes a DPO run, but its reference log-probs ({self.folder / TABLE}) are "
                            f"{'missing' if not (self.folder / TABLE).exists() else 'for other data or weights'}: the "
                            f"trained weights cannot stand in for the reference. Restore {self.folder}, or start over "
                            f"by moving {self.checkpoints} away.")
        import torch

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                table = {split: pair_logps(model, ds, self.objective.collate, self.micro, args.device,
                                           label=f"finetune: reference log-probs ({split} pairs)", stop=self.stop)
                         for split, ds in self.datasets.items()}
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - t0
        self.objective.reference = table
        if state.is_world_process_zero:
            self._write(table, seconds)
        d = dist_if_initialized()
        if d:
            d.barrier()  # rank 0 has written it before anyone trains (a stop during step 1 resumes from it)
        say(f"finetune: reference log-probs of the starting model: {sum(len(t) for t in table.values()):,} pairs "
            f"({', '.join(f'{len(t):,} {s}' for s, t in table.items())}) in {seconds:.1f} s, cached in "
            f"{self.folder} (key {self.key['key']})", flush=True)

    def _read(self) -> dict | None:
        import torch

        m = mf.read(self.folder / "manifest.json")
        if not m or m.get("key") != self.key["key"] or not (self.folder / TABLE).exists():
            return None
        table = torch.load(self.folder / TABLE, weights_only=True)
        if {s: len(t) for s, t in table.items()} != {s: len(ds) for s, ds in self.datasets.items()}:
            return None
        return table

    def _write(self, table: dict, seconds: float) -> None:
        import torch

        (self.folder / "manifest.json").unlink(missing_ok=True)  # the table is valid once its manifest says so
        buf = io.BytesIO()  # n pairs x 2 float64: small
        torch.save(table, buf)
        mf.write_atomic(self.folder / TABLE, buf.getvalue())
        mf.write(self.folder / "manifest.json", {**self.key, "pairs": {s: len(t) for s, t in table.items()},
                                                 "seconds": round(seconds, 2), "sha256": mf.sha256(self.folder / TABLE)})
