"""`zerotune train RECIPE`: HF Trainer + DeepSpeed ZeRO-3, one code path from CPU to 8xV100.

Launcher side (no RANK in the environment): materialise the base model if the
recipe initialises from a config, print the plan, and start torchrun with one
process per GPU (or `train.cpu_procs` CPU processes). Worker side: derive
gradient accumulation from the world size, create TrainingArguments (with the
DeepSpeed config) *before* the model so ZeRO-3 shards weights at load time,
train, save a consolidated model and verify it by reloading.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from . import batch as batchmod
from . import ds_config, hardware, peft_utils, quiet
from . import errors
from . import manifest as mf
from .config import Recipe, resolve_path
from .data.prepare import load_tokenizer, require_prepared
from .errors import UserError
from .layout import layout
from .verify import model_dtype, probe_inputs


PROBE_FILE = "zerotune_probe.pt"
_DIST_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"}


def finalize(r: Recipe) -> dict:
    """Launcher side, after the workers exit: verify the consolidated save, then publish it.

    Runs in a fresh process so that reloading cannot trigger ZeRO-3 collectives; the old
    model folder is replaced only once the new one has passed verification.
    """
    import torch

    from .metrics import plot_curves
    from .verify import verify_saved_model

    torch.set_num_threads(job_cpus())  # CPU forwards over the reloaded model: every core the job was given
    tmp, out = layout(r).model_staging, layout(r).model
    ref = torch.load(tmp / PROBE_FILE)
    if peft_utils.enabled(r):
        # adapter-only save: verify the adapter, merge it into the 16-bit base, publish adapter/ and model/
        report = peft_utils.finalize_peft(r, tmp, out, ref, layout(r).base,
                                          lambda p: load_tokenizer(r).save_pretrained(p))
    else:
        report = verify_saved_model(tmp, ref["n_params"], ref["probe"], ref["logits"], ref["precision"])
        (tmp / PROBE_FILE).unlink()
        (tmp / "training_args.bin").unlink(missing_ok=True)  # pickled args: not needed to load the model
        mf.publish(tmp, out)
    run = mf.read(layout(r).run_json) or {}
    hist = mf.read_jsonl(layout(r).metrics)
    losses = [h["loss"] for h in hist if "loss" in h]
    manifest = {"stage": "train", "recipe": r.name, "model": str(out), **run,
                "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                "verify": report, "model_sha256": {f: mf.sha256(out / f) for f in report["files"]}}
    mf.write(layout(r).train / "manifest.json", manifest)
    mf.write_resolved_recipe(layout(r).train, r)
    plot_curves(layout(r).metrics, layout(r).train / "curves.png")
    losses = " -> ".join(f"{x:.4f}" if x is not None else "n/a" for x in (manifest["first_loss"], manifest["final_loss"]))
    print(f"train: done in {run.get('elapsed_s', 0):.0f}s; loss {losses}; "
          f"verified and published {out} ({report['params']:,} parameters, max |logit diff| after reload "
          f"{report['max_abs_logit_diff']:.2e})", flush=True)
    return manifest


def materialise_base(r: Recipe) -> Path:
    """Random-init a model from `init_config` once, deterministically, with the tokenizer beside it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = layout(r).base
    if r.model.name_or_path:
        return out
    cfg_path = resolve_path(r.model.init_config)
    stamp = {"init_config_sha256": mf.sha256(cfg_path), "init_seed": r.model.init_seed}
    if mf.read(out / "zerotune_base.json") == stamp:
        return out
    torch.manual_seed(r.model.init_seed)
    config = AutoConfig.from_pretrained(cfg_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok = load_tokenizer(r)
    tok.save_pretrained(tmp)
    mf.write(tmp / "zerotune_base.json", stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"train: initialised {sum(p.numel() for p in model.parameters()):,} parameters from "
          f"{r.model.init_config} (seed {r.model.init_seed}) -> {out}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def before_launch(r: Recipe, skip_preflight: bool = False) -> None:
    """What is checked and built before any worker starts; slurm/job.py runs it too, before srun."""
    from .plan import disk_preflight, preflight

    require_prepared(r)  # fail here, in seconds, not after the launch
    if not skip_preflight:
        preflight(r)  # predicted not to fit -> PlanError with the suggested change (--skip-preflight overrides)
        disk_preflight(r, r.out)
    materialise_base(r)


def launch(r: Recipe, argv: list[str], skip_preflight: bool = False) -> int:
    """Start the distributed job; returns its exit code."""
    import torch

    before_launch(r, skip_preflight)
    n_gpu = torch.cuda.device_count()
    nproc = n_gpu if n_gpu > 0 else r.train.cpu_procs
    env = dict(os.environ)
    if n_gpu == 0:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's accelerator plumbing; gloo without oneCCL
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default then: stated here, it prints no banner about it
    torchrun = [f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
                "-m", "zerotune", *argv]
    print(f"train: launching {nproc} {'GPU' if n_gpu else 'CPU'} processes: torchrun {' '.join(torchrun)}", flush=True)
    errors.clear_handoffs(layout(r).train)
    # torchrun through errors.torchrun: on a worker's user error, its failure report stays off the terminal
    rc = subprocess.call([sys.executable, "-c", "import sys; from zerotune.errors import torchrun; torchrun(sys.argv[1:])",
                          str(layout(r).train), *torchrun], env=env)
    stopped = mf.read(layout(r).stopped)
    if rc != 0 and stopped:
        if stopped.get("committed"):
            print(f"train: stopped on {stopped['signal']} at step {stopped['step']} with committed checkpoint "
                  f"{stopped['checkpoint']}; run the same command again to resume.", flush=True)
        else:
            print(f"train: stopped on {stopped['signal']} before training started, without a new checkpoint; run "
                  f"the same command again to resume from {stopped['checkpoint'] or 'the beginning'}.", flush=True)
        return 75
    handoff = errors.read_handoff(layout(r).train) if rc != 0 else None
    if handoff:  # a worker's user error, printed once by local rank 0 unless only another rank hit it
        if not handoff["printed"]:
            print(f"zerotune: {handoff['message']}", file=sys.stderr, flush=True)
        return errors.EXIT_CODE
    if rc != 0:
        print(f"train: the distributed job failed (exit {rc}); {layout(r).model} and committed checkpoints "
              "are untouched.", file=sys.stderr, flush=True)
    return rc


def _collate_packed(rows):
    import torch

    return {k: torch.tensor([row[k] for row in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}


def _make_collate_padded(pad_id: int):
    import torch

    def collate(rows):
        n = max(len(row["input_ids"]) for row in rows)
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        for row in rows:
            pad = n - len(row["input_ids"])
            out["input_ids"].append(row["input_ids"] + [pad_id] * pad)
            out["labels"].append(row["labels"] + [-100] * pad)
            out["attention_mask"].append([1] * len(row["input_ids"]) + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}

    return collate


def training_arguments(r: Recipe, bp: batchmod.BatchPlan, choice: hardware.Choice, on_gpu: bool, max_steps: int):
    from transformers import TrainingArguments

    return TrainingArguments(**training_kwargs(r, bp, choice, on_gpu, max_steps))


def training_kwargs(r: Recipe, bp: batchmod.BatchPlan, choice: hardware.Choice, on_gpu: bool, max_steps: int) -> dict:
    """The recipe as TrainingArguments fields; bench/bench_train.py builds its Trainer and TRL baselines from
    the same dict, so every contender trains with the same hyper-parameters."""
    return dict(
        output_dir=str(layout(r).checkpoints),
        per_device_train_batch_size=r.train.micro_batch_size,
        gradient_accumulation_steps=bp.grad_accum,
        max_steps=max_steps,
        learning_rate=r.train.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": r.train.min_lr_ratio},
        warmup_steps=r.train.warmup_ratio,  # transformers 5: a value below 1 is a fraction of the total steps
        weight_decay=r.train.weight_decay,
        adam_beta2=r.train.adam_beta2,
        max_grad_norm=r.train.max_grad_norm,
        fp16=choice.precision == "fp16",
        bf16=choice.precision == "bf16",
        activation_checkpointing=r.train.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        deepspeed=ds_config.build(r, bp, max_steps),  # fp16 loss scale from GA and the run length
        use_cpu=not on_gpu,
        logging_steps=r.train.logging_steps,
        logging_nan_inf_filter=False,  # a NaN must be seen, not averaged away
        save_strategy="steps" if r.train.save_steps > 0 else "no",
        save_steps=r.train.save_steps if r.train.save_steps > 0 else 500,
        save_total_limit=None,  # CommitCheckpoints rotates, after a commit: HF deletes before the new one is good
        report_to=[] if r.train.report_to == "none" else [r.train.report_to],
        run_name=r.name,
        seed=r.train.seed,
        data_seed=r.train.seed,
        remove_unused_columns=False,
        # unpacked: batch documents of similar length so padding stays small (packed rows are all seq_len)
        train_sampling_strategy="random" if r.data.packing else "group_by_length",
        dataloader_num_workers=0,
        disable_tqdm=True,
        average_tokens_across_devices=True,
        ddp_timeout=3600,
    )


def total_steps(n_sequences: int, bp: batchmod.BatchPlan, r: Recipe) -> int:
    if r.train.max_steps > 0:
        return r.train.max_steps
    per_epoch = n_sequences // bp.sequences_per_step
    if per_epoch == 0:
        raise UserError(f"the prepared data has {n_sequences} sequences, fewer than one optimizer step "
                         f"({bp.sequences_per_step}); lower train.global_batch_tokens or add data.")
    return max(1, int(per_epoch * r.train.epochs))


def job_cpus() -> int:
    """CPUs this job may use: the process's affinity mask (SLURM's cgroup/cpuset), capped by SLURM_CPUS_ON_NODE."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slurm = os.environ.get("SLURM_CPUS_ON_NODE", "")
    return max(1, min(n, int(slurm)) if slurm.isdigit() else n)


def worker(r: Recipe) -> None:
    """Train and save on every rank; then the other ranks exit and rank 0, with the trainer freed, runs finalize.

    Finalize runs without any collective, so no rank waits in a barrier (ddp_timeout) while it reloads and
    checks the model, and the GPU and host memory of the training states is released first (a QLoRA
    finalize reloads the 4-bit base on the same GPU; an optimizer offload pins host RAM)."""
    import gc

    import torch

    model_ref = _train_and_save(r)
    if model_ref is None:
        return
    # Module-level state that keeps the trained model (and through its hooks the Trainer) alive after training:
    if "deepspeed.runtime.zero.parameter_offload" in sys.modules:  # the ZeRO-3 top module, appended at setup
        sys.modules["deepspeed.runtime.zero.parameter_offload"].FWD_MODULE_STACK.clear()  # and never popped
    if "deepspeed.runtime.zero.partitioned_param_coordinator" in sys.modules:  # an lru_cache on a method: it
        ppc = sys.modules["deepspeed.runtime.zero.partitioned_param_coordinator"].PartitionedParameterCoordinator
        f = getattr(ppc, "_PartitionedParameterCoordinator__params_to_release", None)  # keeps every (self,
        for g in [f, *(c.cell_contents for c in (getattr(f, "__closure__", None) or ()))]:  # submodule) it saw;
            if hasattr(g, "cache_clear"):  # under DeepSpeed's instrument_w_nvtx wrapper, which has no __wrapped__
                g.cache_clear()
    if "bitsandbytes" in sys.modules:  # paged optimizer states (bitsandbytes functional.GlobalPageManager)
        sys.modules["bitsandbytes"].functional.GlobalPageManager.get_instance().paged_tensors.clear()
    gc.collect()  # the Trainer, DeepSpeed engine and callbacks reference each other: cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if model_ref() is None:
        print("train: training states released; finalizing", flush=True)
    else:  # every CPU run so far, ZeRO-3 and QLoRA alike: a reference not yet found (README, Finalize)
        print("train: the trained model is still referenced after training (rank 0's share of the training "
              "states stays allocated); finalizing beside it", flush=True)
    # Verify and publish in a fresh process: reloading here would run ZeRO-3 collectives, and
    # the same step must run whether torchrun was started by `zerotune train` or by sbatch.
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["OMP_NUM_THREADS"] = str(job_cpus())  # the launcher set 1 per training rank; finalize is alone now
    subprocess.check_call([sys.executable, "-m", "zerotune", *sys.argv[1:], "--finalize"], env=env)


def _train_and_save(r: Recipe):
    """Returns a weak reference to the trained model on the rank that must finalize, else None."""
    import weakref

    from .checkpoint import StopOnSignal

    stop = StopOnSignal()  # first: a SIGUSR1 while loading must be remembered, not kill the process
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, Trainer

    from . import faults
    from .checkpoint import (REQUEUE_EXIT, CommitCheckpoints, StopBeforeTraining, check_world_size,
                             describe_failure, discard_after, last_committed, step_of)
    from .evaluation import EvalDuringTraining
    from .metrics import StepMetrics, flops_per_token

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    check_world_size(last_committed(layout(r).checkpoints, quiet=True), world)  # before anything is loaded
    # DeepSpeed 0.19 calls this torch API on every ZeRO-3 reduce: hundreds of identical lines per run bury the log
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
    if r.train.report_to == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")  # log locally; `wandb sync` later. Keys never printed.
        if rank == 0:
            print("train: WANDB_API_KEY not set: wandb logs offline to ./wandb", flush=True)
    gpu = hardware.detect()
    choice = hardware.choose(gpu, r.train.precision, r.train.attention, r.train.liger)
    data_manifest = require_prepared(r)
    bp = batchmod.derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, world)
    train_ds = load_from_disk(str(layout(r).data / "train"))
    steps = total_steps(len(train_ds), bp, r)
    args = training_arguments(r, bp, choice, gpu.capability is not None, steps)  # before the model: ZeRO-3 zero.Init
    if peft_utils.enabled(r):
        peft_utils.set_optim(args, r)
    if args.deepspeed:
        # zero.Init (inside from_pretrained) reads the world size from deepspeed.comm, which the Trainer
        # does not set up under use_cpu=True: without this it sees world 1 and rejects the batch config.
        import deepspeed
        with quiet.drop_stdout_lines("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"):
            deepspeed.init_distributed(dist_backend="gloo" if gpu.capability is None else "nccl")
        # accelerate's plugin says GA 1 under DeepSpeed and takes the config's: harmless when that is ours
        quiet.drop_log("accelerate.accelerator", f"GradientAccumulationPlugin has 1, DeepSpeed config has {bp.grad_accum}.")

    if rank == 0:
        zero = (args.hf_deepspeed_config.config.get("zero_optimization", {}) if args.deepspeed else {})
        print(f"train: {gpu.name}, world size {world}, {choice.describe()}; " + "; ".join(choice.reasons), flush=True)
        if gpu.capability is not None: print(f"train: torch {torch.__version__} (CUDA {torch.version.cuda}) kernels for {torch.cuda.get_arch_list()}", flush=True)  # noqa: E501,E701 - a wheel without this GPU's sm fails at its first kernel
        print(f"train: {bp.describe()}; {steps} optimizer steps "
              f"({len(train_ds)} sequences, {bp.sequences_per_step} per step)", flush=True)
        if args.deepspeed:
            print(f"train: DeepSpeed ZeRO stage {zero.get('stage')} with world size {world}", flush=True)

    if choice.liger:
        # Patch the model classes before instantiation: Liger's fused linear cross entropy then runs
        # inside LlamaForCausalLM.forward, where ZeRO-3 has gathered lm_head (trl #3368, Liger #1048).
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False)
    src = layout(r).base
    load_kw = {"dtype": model_dtype(choice.precision), **peft_utils.load_kwargs(r, gpu.capability is not None)}
    model = AutoModelForCausalLM.from_pretrained(str(src), attn_implementation=choice.attention, **load_kw)
    model.config.use_cache = False  # packed position_ids -> block-causal mask only without a KV cache

    cfg = model.config
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())  # ZeRO-3 shards
    n_trainable = None
    if peft_utils.enabled(r):
        model, n_trainable, n_all = peft_utils.wrap(model, r)
        if rank == 0:
            print(f"train: peft {r.peft.method} r={r.peft.r} alpha={r.peft.alpha} on {r.peft.target_modules}"
                  f"{' + full ' + str(r.peft.modules_to_save) if r.peft.modules_to_save else ''}: "
                  f"{n_trainable:,} trainable of {n_all:,} parameters ({100 * n_trainable / n_all:.3f}%)", flush=True)
    tokens_per_step = bp.global_batch_tokens
    label_fraction = data_manifest["tokens"]["train_label"] / max(1, data_manifest["tokens"]["train_total"])
    metrics = StepMetrics(layout(r).metrics, tokens_per_step, label_fraction,
                          flops_per_token(n_params, cfg.num_hidden_layers, cfg.hidden_size, r.data.seq_len),
                          gpu.peak_tflops, world)
    collate = _collate_packed if r.data.packing else _make_collate_padded(data_manifest["pad_token_id"])
    commit = CommitCheckpoints(r.train.save_total_limit)
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, data_collator=collate,
                      callbacks=[metrics, EvalDuringTraining(r, metrics), stop, commit, *faults.callbacks(model)])
    metrics.attach(trainer)
    metrics.count_labels(model)
    # fp16 underflow at large GA shows as zero gradient elements; Liger fp16 lm_head grads can overflow unscaled
    metrics.watch_grads(model, check_lm_head=choice.liger and choice.precision == "fp16")
    if getattr(trainer.accelerator, "scaler", None) is not None:  # fp16 without DeepSpeed: torch's GradScaler
        trainer.accelerator.scaler = ds_config.amp_grad_scaler(bp.grad_accum, steps)
    resume = last_committed(layout(r).checkpoints, quiet=rank != 0)
    if dist.is_initialized():
        dist.barrier()  # every rank has chosen before rank 0 removes anything
    if rank == 0:
        layout(r).train.mkdir(parents=True, exist_ok=True)
        layout(r).stopped.unlink(missing_ok=True)
        discard_after(layout(r).checkpoints, resume)
        metrics.rewind(step_of(resume) if resume else 0)
        if resume:
            print(f"train: resuming from committed checkpoint {resume}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.time()
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except StopBeforeTraining as e:
        if rank == 0:
            print(f"train: {e}: stopping without a new checkpoint; a rerun resumes from "
                  f"{resume or 'the beginning'}", flush=True)
            mf.write(layout(r).stopped, {"step": step_of(resume) if resume else 0, "signal": stop.requested,
                                                      "checkpoint": str(resume) if resume else None, "committed": False})
        if dist.is_initialized():
            dist.barrier()
        sys.exit(REQUEUE_EXIT)
    except Exception as e:
        # every rank says it: the rank that failed first may be the only one left to print anything
        print(f"[rank {rank}] " + describe_failure(e, layout(r).checkpoints, commit.saving), file=sys.stderr, flush=True)
        raise
    elapsed = time.time() - t0
    if stop.stopped_at is not None:
        if rank == 0:
            mf.write(layout(r).stopped, {"step": stop.stopped_at, "signal": stop.reason,
                                                      "checkpoint": str(last_committed(layout(r).checkpoints)),
                                                      "committed": True})
        if dist.is_initialized():
            dist.barrier()
        sys.exit(REQUEUE_EXIT)

    # a short prefix of one row, logits kept in the training dtype: size bounded whatever seq_len (verify.py)
    probe = {k: v.to(args.device) for k, v in probe_inputs(collate([train_ds[0]])).items()}
    with torch.no_grad():
        trainer.model_wrapped.eval()
        ref_logits = trainer.model_wrapped(**probe, use_cache=False).logits  # use_cache=False as finalize
        ref_logits = ref_logits.to(model_dtype(choice.precision)).cpu()
    tmp = layout(r).model_staging
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    trainer.save_model(str(tmp))  # ZeRO-3: gathers the 16-bit weights into one consolidated file on rank 0
    # (peft: save_model writes only the adapter; finalize merges it into the 16-bit base)
    if rank == 0:
        load_tokenizer(r).save_pretrained(tmp)
        torch.save({"probe": {k: v.cpu() for k, v in probe.items()}, "logits": ref_logits, "n_params": n_params,
                    "precision": choice.precision, "trainable_params": n_trainable}, tmp / PROBE_FILE)
        mf.write(layout(r).run_json, {
            "world_size": world, "device": gpu.name, "data_fingerprint": data_manifest["fingerprint"],
            "choice": {"precision": choice.precision, "attention": choice.attention, "liger": choice.liger},
            "batch": {"global_batch_tokens": bp.global_batch_tokens, "seq_len": bp.seq_len,
                      "micro_batch_size": bp.micro_batch_size, "grad_accum": bp.grad_accum},
            "steps": steps, "elapsed_s": round(elapsed, 1), "base": str(src)})
    if dist.is_initialized():
        dist.barrier()  # the last collective: every rank has saved, rank 0 has written the probe
        dist.destroy_process_group()
    return weakref.ref(model) if rank == 0 else None
