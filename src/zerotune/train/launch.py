"""The parent process of `zerotune finetune`: check and build what the workers need, resolve the recipe into the
run folder, then start torchrun (`python -m zerotune.train torchrun RUN_DIR ...`, see __main__.py).

slurm/job.py runs `before_launch` too, before srun starts the same torchrun on every node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import batch as batchmod
from .. import errors, reshard
from .. import manifest as mf
from ..answering import load_rows
from ..checkpoint import last_committed
from ..config import Recipe, resolve_path
from ..data.cache import load_tokenizer, require_prepared
from ..hardware import require_kernels
from ..hub import require_weights
from ..rl import rewards
from ..layout import layout, write_resolved_recipe
from ..planner.compute import compute_plan
from ..planner.gate import disk_preflight, preflight
from ..planner.records import Plan
from ..ports import free_port
from ..stopping import REQUEUE_EXIT, Stopped, seconds_needed
from .handoff import Outcome


def materialise_base(r: Recipe) -> Path:
    """Random-init a model from `init_config` once, deterministically, with the tokenizer beside it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = layout(r)
    out = paths.base
    if r.model.name_or_path:
        return out
    cfg_path = resolve_path(r.model.init_config)
    stamp = {"init_config_sha256": mf.sha256(cfg_path), "init_seed": r.model.init_seed}
    if mf.read(paths.base_stamp) == stamp:
        return out
    torch.manual_seed(r.model.init_seed)
    config = AutoConfig.from_pretrained(cfg_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    load_tokenizer(r).save_pretrained(tmp)
    mf.write(tmp / paths.base_stamp.name, stamp)
    mf.publish(tmp, out)
    print(f"finetune: initialised {sum(p.numel() for p in model.parameters()):,} parameters from "
          f"{r.model.init_config} (seed {r.model.init_seed}) -> {out}")
    return out


def before_launch(r: Recipe, world: int | None = None, skip_preflight: bool = False, plan=None,
                  convert_by: float | None = None) -> None:
    """What is checked and built before any worker starts, and the recipe every process of the run reads.
    world: the job's process count; a committed checkpoint written at another one is converted here
    (reshard.py), once, before any worker waits on it (None: the caller launches no training).
    plan: the launch's planner.compute.Plan when the caller has it already (slurm/job.py prints it first); computed
    here otherwise, once, and handed to the memory gate, the disk gate and the conversion.
    convert_by: the unix time a conversion must end by (slurm/job.py: the job's time-limit warning); None: no limit.
    A stop while converting raises stopping.Stopped, with nothing half-built left (reshard.build_conversion)."""
    require_kernels()  # a torch wheel without this GPU's architecture fails every CUDA op, after minutes of loading
    require_weights(r)  # on this node, offline: the workers never download (`zerotune fetch` does, beforehand)
    require_prepared(r)  # fail here, in seconds, not after the launch
    for es in r.eval_sets():  # the end of training answers the first set's prompts (validation._sample_prompts), and
        load_rows(es)        # check scores them all: a missing file or a bad row fails now, not after the last step
    if r.grpo:
        rewards.load(r.rl)  # a reward's dotted path that does not import fails here, not in every worker
        from ..rl.prompts import refuse_long_prompts  # numpy (data.tokenize) stays off the CLI's start

        refuse_long_prompts(r)  # a prompt that leaves less than rl.max_new_tokens: here, not mid-run
    if world is not None:  # a resume that cannot keep the global batch: its own message, before the plan's
        ckpt = last_committed(layout(r).checkpoints, quiet=True)
        saved = reshard.saved_world_if_other(ckpt, world)
        if saved is not None:
            reshard.refuse_unresumable(r, ckpt, saved, world)
        batchmod.of_recipe(r, world)  # these processes hold the recipe's batch and its sequence-parallel groups
    plan = plan or compute_plan(r)
    if not skip_preflight:
        preflight(plan, r)  # predicted not to fit -> PlanError with the suggested change (--skip-preflight overrides)
        disk_preflight(plan, r, r.out)
    if world is not None:
        reshard.convert_for(r, world, free_needed=plan.disk.needed_free_bytes, convert_by=convert_by)
    _refuse_reference_pass_without_time(r, plan, convert_by)
    materialise_base(r)
    write_resolved_recipe(layout(r).train, r)  # layout(r).run_recipe: what the workers and finalize read
    mf.write(layout(r).run_plan, plan.to_json())  # the phase times the workers' deadline reserves (stopping.py)
    layout(r).stopped.unlink(missing_ok=True)  # how the workers end is read after they do: only theirs may be there
    errors.clear_handoffs(layout(r).train)


def _refuse_reference_pass_without_time(r: Recipe, plan: Plan, convert_by: float | None) -> None:
    """A DPO run's first attempt computes the reference log-probs before its first step (preference/reference.py):
    one pass that a time-limit warning stops with nothing kept, so a job whose time before the warning cannot hold
    the planned pass would requeue into the same stop forever. Refused up front, as a conversion is (reshard.py)."""
    import time

    reference = plan.phases.reference
    seconds = reference.time.seconds if reference and reference.time else None
    if (convert_by is None or not r.pairs or seconds is None or last_committed(layout(r).checkpoints, quiet=True)
            or (layout(r).reference / "manifest.json").exists()):
        return
    need, left = seconds_needed(seconds, 0), convert_by - time.time()
    if need > left:
        raise errors.UserError(
            f"{r.name}: the reference log-prob pass before DPO's first step is planned at {seconds / 3600:.1f} h "
            f"({need / 3600:.1f} h with the margin; `zerotune plan {r.name}`, phase reference), but this job has "
            f"{max(left, 0) / 3600:.1f} h before its time-limit warning, which would stop the pass with nothing kept: "
            f"not started. Resubmit with a --time at least {(need - left) / 3600 + 0.1:.1f} h longer, or on more nodes "
            f"(the pass divides over every GPU); the table is cached for every later job.")


def launch(r: Recipe, skip_preflight: bool = False) -> int:
    """Start the distributed job; returns its exit code."""
    import torch

    n_gpu = torch.cuda.device_count()
    nproc = n_gpu if n_gpu > 0 else r.train.cpu_procs
    try:
        before_launch(r, nproc, skip_preflight)
    except Stopped as e:  # SIGUSR1/SIGTERM while converting a checkpoint (reshard.build_conversion)
        print(f"finetune: stopped on {e.signal}, {e.detail}; run the same command again to resume.", flush=True)
        return REQUEUE_EXIT
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"  # before_launch found the weights locally: no rank contacts the hub
    if n_gpu == 0:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's accelerator plumbing; gloo without oneCCL
        # what DeepSpeed's own launcher sets (launcher/launch.py): without it the CPU accelerator's device_count()
        # runs `numactl` on every reduce-scatter (cpu_accelerator.py:70-79, stage3.py:1925), ~1 ms each here
        env["LOCAL_SIZE"] = str(nproc)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default then: stated here, it prints no banner about it
    port = free_port()
    torchrun = [f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
                "-m", "zerotune.train", "worker", str(r.out)]
    print(f"finetune: launching {nproc} {'GPU' if n_gpu else 'CPU'} processes: torchrun {' '.join(torchrun)}", flush=True)
    try:
        rc = subprocess.call([sys.executable, "-m", "zerotune.train", "torchrun", str(r.out), *torchrun], env=env)
    finally:
        remove_shm_buffers("127.0.0.1", port)
    return _say_outcome(r, Outcome.read(layout(r), rc))


def remove_shm_buffers(addr: str, port: int) -> list[str]:
    """DeepSpeed's CPU all-reduce creates one POSIX shared-memory buffer per rank (deepspeed 0.19.8
    ops/csrc/cpu/comm/shm.cpp:349-368: /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>,
    64 MiB each) and never unlinks it (shared_close, :79-84, has no caller), killed or not: each CPU run would keep
    2 x 67 MB of RAM until reboot (258 of them had filled 17 of this machine's 24 GB and got a worker OOM-killed).
    The launcher knows the run's address and port, and removes them once its workers are gone."""
    gone = []
    for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone


def _say_outcome(r: Recipe, o: Outcome) -> int:
    """What the workers' exit means, in one line: stopped (REQUEUE_EXIT: run again to resume), a user error (2), a failure."""
    stopped, rc = o.stopped, o.rc
    if stopped:
        if stopped.committed:
            print(f"finetune: stopped on {stopped.signal} at step {stopped.step} with committed checkpoint "
                  f"{stopped.checkpoint}; run the same command again to resume.", flush=True)
        else:
            print(f"finetune: stopped on {stopped.signal} before training started, without a new checkpoint; run "
                  f"the same command again to resume from {stopped.checkpoint or 'the beginning'}.", flush=True)
        return REQUEUE_EXIT
    if o.user_error:  # printed once by local rank 0 unless only another rank hit it
        if not o.user_error["printed"]:
            print(f"zerotune: {o.user_error['message']}", file=sys.stderr, flush=True)
        return errors.EXIT_CODE
    if rc != 0:
        print(f"finetune: the distributed job failed (exit {rc}); {layout(r).model} and committed checkpoints "
              "are untouched.", file=sys.stderr, flush=True)
    return rc
