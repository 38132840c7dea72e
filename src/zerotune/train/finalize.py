"""Rank 0's last process of a run (`python -m zerotune.train finalize RUN_DIR`): verify the consolidated save,
then publish it.

A fresh process, so that reloading cannot trigger ZeRO-3 collectives; the other ranks have exited. The old
model/ is replaced only once the new one has passed verification (PEFT: the adapter is verified, merged into
the 16-bit base, and both adapter/ and model/ are published).
"""

from __future__ import annotations

import os

from .. import adapters
from .. import manifest as mf
from ..config import Recipe
from ..data.cache import load_tokenizer
from ..layout import layout
from ..verify import verify_saved_model
from .handoff import Probe, RunRecord


def job_cpus() -> int:
    """CPUs this job may use: the process's affinity mask (SLURM's cgroup/cpuset), capped by SLURM_CPUS_ON_NODE."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slurm = os.environ.get("SLURM_CPUS_ON_NODE", "")
    return max(1, min(n, int(slurm)) if slurm.isdigit() else n)


def finalize(r: Recipe) -> dict:
    import torch

    from ..metrics import plot_curves

    torch.set_num_threads(job_cpus())  # CPU forwards over the reloaded model: every core the job was given
    paths = layout(r)
    tmp, out = paths.model_staging, paths.model
    ref = Probe.load(tmp)
    if adapters.enabled(r):
        report = adapters.finalize_peft(r, tmp, out, ref, paths.base, lambda p: load_tokenizer(r).save_pretrained(p))
    else:
        report = verify_saved_model(tmp, ref.n_params, ref.probe, ref.logits, ref.precision, ref.attention)
        Probe.discard(tmp)
        (tmp / "training_args.bin").unlink(missing_ok=True)  # pickled args: not needed to load the model
        mf.publish(tmp, out)
    run = RunRecord.read(paths.run_json)
    rows = [h for h in mf.read_jsonl(paths.metrics) if "loss" in h]
    losses = [h["loss"] for h in rows]
    # GRPO: its loss is ~0 by construction (advantages sum to 0 per group); what moved is the rollouts' reward
    rewards = [h["rl/reward"] for h in rows if "rl/reward" in h]
    manifest = {"stage": "finetune", "recipe": r.name, "model": str(out), **(vars(run) if run else {}),
                "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                **({"first_reward": rewards[0], "final_reward": rewards[-1]} if rewards else {}),
                "verify": report, "model_sha256": {f: mf.sha256(out / f) for f in report["files"]}}
    mf.write(paths.train_manifest, manifest)
    plot_curves(paths.metrics, paths.curves)
    shown = "loss " + " -> ".join(f"{x:.4f}" if x is not None else "n/a"
                                  for x in (manifest["first_loss"], manifest["final_loss"]))
    if rewards:  # one step's few prompts are noisy: the first and last fifth of the run
        k = max(1, len(rewards) // 5)
        shown = (f"rollouts' mean reward {sum(rewards[:k]) / k:.3f} (first {k} steps) -> "
                 f"{sum(rewards[-k:]) / k:.3f} (last {k})")
    print(f"finetune: done in {run.elapsed_s if run else 0:.0f}s; {shown}; "
          f"verified and published {out} ({report['params']:,} parameters, max |logit diff| after reload "
          f"{report['max_abs_logit_diff']:.2e})", flush=True)
    return manifest
