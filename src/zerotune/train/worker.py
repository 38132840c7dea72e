"""Every rank's process under torchrun: set up, load, train, save; then rank 0 hands over to finalize.

Read `worker` first: it is the whole run in named steps. TrainingArguments (with the DeepSpeed config)
exist *before* the model, so ZeRO-3 shards the weights while they load (zero.Init).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .. import adapters, attention, ds_config, families, faults, hardware, quiet, reshard
from ..attention import SdpaGuard, training_backends
from .. import batch as batchmod
from ..checkpoint import CommitMarker, describe_failure, discard_after, last_committed, step_of
from ..config import Recipe
from ..data.cache import load_tokenizer, require_prepared
from ..errors import UserError
from ..layout import RunLayout, layout
from ..metrics import StepMetrics, flops_per_token
from ..preference import objective as preference
from ..rl import objective as grpo
from ..safety import SafetyChecks, scaler_gave_up
from ..stopping import REQUEUE_EXIT, StopBeforeTraining, TrainingComplete
from ..verify import model_dtype, probe_inputs
from .args import DDP_TIMEOUT_S, collate_packed, make_collate_padded, total_steps, training_arguments
from .callbacks import CommitCheckpoints, EndAtLastStep, StopOnSignal
from .finalize import job_cpus
from .handoff import Probe, RunRecord, StopRecord
from .reshard_load import CheckUniversalLoad
from .sequence_parallel import SequenceParallelTrainer
from .validation import EvalDuringTraining

_DIST_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"}


def worker(r: Recipe) -> None:
    """Train and save on every rank; then the other ranks exit and rank 0, with the trainer freed, runs finalize.

    Finalize runs without any collective, so no rank waits in a barrier (ddp_timeout) while it reloads and
    checks the model, and the GPU and host memory of the training states is released first (a QLoRA
    finalize reloads the 4-bit base on the same GPU; an optimizer offload pins host RAM)."""
    import weakref

    stop = StopOnSignal()  # first: a SIGUSR1 while loading must be remembered, not kill the process
    run = setup(r)
    model, n_params, n_trainable = load_model(r, run)
    trainer, safety, metrics, commit = build_trainer(r, run, model, n_params, stop)
    resume = choose_resume(r, run, metrics)
    # training, validation and samples on CUDA take a fused SDPA kernel or stop naming the call: never the math
    # kernel's S x S scores, which a new shape or dtype could otherwise fall to without a word
    with SdpaGuard(training_backends(run.on_gpu), strict=True):
        elapsed = train_or_stop(r, run, trainer, stop, commit, resume)
        save_for_finalize(r, run, trainer, n_params, n_trainable, elapsed)
    safety.detach()  # their gradient hooks would keep the Trainer alive (QLoRA: release_training_states)
    metrics.detach()
    stop.end_estimate = lambda: None  # validation's bound method, and through it the Trainer: the signal handler keeps stop
    finalizes, run_dir = run.rank == 0, r.out
    model_ref = weakref.ref(model)
    del run, model, trainer, safety, metrics, commit  # what this function holds; the rest: release_training_states
    if finalizes:
        release_training_states(model_ref)
        start_finalize(run_dir)


@dataclass
class Run:
    """What every step of the worker shares: where the run's files are, this rank, the hardware choice, the batch
    plan and the data."""
    paths: RunLayout  # layout(r), built once
    rank: int
    world: int
    gpu: hardware.GPU
    choice: hardware.Choice
    bp: batchmod.BatchPlan
    data_manifest: dict
    train_ds: object  # datasets.Dataset
    steps: int
    args: object  # transformers.TrainingArguments
    collate: object
    universal: Path | None = None  # resuming a checkpoint of another world size: its conversion (reshard.py)
    saved_world: int | None = None  # ... and the world size that wrote it
    family: families.Family | None = None  # the model's family (families.py): Liger patch, precision limits
    objective: preference.Objective | grpo.Objective | None = None  # DPO or GRPO: collate, loss, Trainer, their callbacks
    probe_collate: object = None  # collates the row the save's verification probe is cut from (an SFT row)

    @property
    def on_gpu(self) -> bool:
        return self.gpu.capability is not None

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"finetune: {msg}", flush=True)


def setup(r: Recipe) -> Run:
    """World size, hardware choice, batch plan, data and TrainingArguments; the process group under DeepSpeed."""
    import torch
    from datasets import load_from_disk

    paths = layout(r)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    resume = last_committed(paths.checkpoints, quiet=True)
    saved, folder = reshard.saved_world_if_other(resume, world), None  # another world size wrote it: before loading
    if saved is not None:
        reshard.refuse_unresumable(r, resume, saved, world)
        folder = reshard.require_conversion(resume, saved, world)  # built by the launcher (train/launch.py before_launch)
    # DeepSpeed 0.19 calls this torch API on every ZeRO-3 reduce: hundreds of identical lines per run bury the log
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
    if r.train.report_to == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")  # log locally; `wandb sync` later. Keys never printed.
        if rank == 0:
            print("finetune: WANDB_API_KEY not set: wandb logs offline to ./wandb", flush=True)
    gpu = hardware.detect()
    family = model_family(paths.base)  # an unknown architecture stops here, before any weight is read
    choice = hardware.choose(gpu, r.train.precision, r.train.attention, r.train.liger, family=family)
    data_manifest = require_prepared(r)
    bp = batchmod.of_recipe(r, world)
    train_ds = load_from_disk(str(paths.data_train))
    steps = total_steps(len(train_ds), bp, r)
    tokens = data_manifest["tokens"]
    args = training_arguments(r, bp, choice, gpu.capability is not None, steps,  # before the model: zero.Init
                              load_universal=saved is not None,
                              label_tokens_per_row=tokens["train_label"] / max(1, bp.rows * len(train_ds)))
    if adapters.enabled(r):
        adapters.set_optim(args, r)
    if args.deepspeed:
        # zero.Init (inside from_pretrained) reads the world size from deepspeed.comm, which the Trainer
        # does not set up under use_cpu=True: without this it sees world 1 and rejects the batch config.
        import deepspeed
        with quiet.drop_stdout_lines("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"):
            deepspeed.init_distributed(dist_backend="gloo" if gpu.capability is None else "nccl",
                                       timeout=timedelta(seconds=DDP_TIMEOUT_S))
        # accelerate's plugin says GA 1 under DeepSpeed and takes the config's: harmless when that is ours
        quiet.drop_log("accelerate.accelerator", f"GradientAccumulationPlugin has 1, DeepSpeed config has {bp.grad_accum}.")
    sft_collate = (collate_packed if r.data.packing else
                   make_collate_padded(data_manifest["pad_token_id"], r.train.sequence_parallel))
    # DPO's pieces (preference/) or GRPO's (rl/); None: SFT
    objective = (preference.for_recipe(r, data_manifest["pad_token_id"])
                 or grpo.for_recipe(r, data_manifest["pad_token_id"]))
    collate = objective.collate if objective else sft_collate
    run = Run(paths, rank, world, gpu, choice, bp, data_manifest, train_ds, steps, args, collate, folder, saved, family,
              objective, probe_collate=make_collate_padded(data_manifest["pad_token_id"]) if objective else collate)

    run.say(f"{gpu.name}, world size {world}, {choice.describe()}; " + "; ".join(choice.reasons))
    if run.on_gpu:  # a wheel without this GPU's sm fails at its first kernel
        run.say(f"torch {torch.__version__} (CUDA {torch.version.cuda}) kernels for {torch.cuda.get_arch_list()}")
    samples = "pairs" if r.pairs else "prompts" if r.grpo else "sequences"
    run.say(f"{bp.describe()}; {steps} optimizer steps ({len(train_ds)} {samples}, "
            f"{bp.sequences_per_step} per step)")
    if objective:
        run.say(objective.describe())
    if saved is not None:
        was = CommitMarker.read(resume).grad_accum  # None in older markers: the same batch at the old world
        was = was or batchmod.derive(bp.global_batch_tokens, bp.seq_len, bp.micro_batch_size, saved, bp.rows,
                                     bp.sequence_parallel).grad_accum
        run.say(f"world size {saved} -> {world}: DeepSpeed loads {resume.name}'s universal conversion ({folder}); "
                f"grad-accum {was} -> {bp.grad_accum}, the global batch of {bp.global_batch_tokens:,} tokens and "
                "the sequences of each step unchanged")
    if args.deepspeed:
        zero = args.hf_deepspeed_config.config.get("zero_optimization", {})
        run.say(f"DeepSpeed ZeRO stage {zero.get('stage')} with world size {world}")
    return run


def model_family(base: Path) -> families.Family:
    """The base model's family from its config.json alone (a hub id: the config in the HF cache)."""
    from transformers import AutoConfig

    return families.of_config(AutoConfig.from_pretrained(str(base)))


def load_model(r: Recipe, run: Run):
    """The base model, sharded at load under ZeRO-3, Liger-patched where chosen, PEFT-wrapped for a PEFT recipe.
    Returns (model, parameters, trainable parameters or None)."""
    from transformers import AutoModelForCausalLM

    if run.choice.liger:
        # Patch the model classes before instantiation: Liger's fused linear cross entropy then runs
        # inside <Family>ForCausalLM.forward, where ZeRO-3 has gathered lm_head (trl #3368, Liger #1048).
        families.apply_liger(run.family)
        run.say(f"liger: {run.family.liger}({', '.join(f'{k}={v}' for k, v in run.family.liger_kernels.items())})")
    load_kw = {"dtype": model_dtype(run.choice.precision),
               **adapters.load_kwargs(r, run.on_gpu, run.choice.precision)}
    model = AutoModelForCausalLM.from_pretrained(str(run.paths.base),
                                                 attn_implementation=attention.load_name(run.choice.attention),
                                                 **load_kw)
    model.config.use_cache = False  # packed position_ids -> block-causal mask only without a KV cache
    if run.objective:
        run.objective.attach(model)  # its forward answers DPO's pairs or GRPO's rollouts with a fused loss
    if (run.choice.liger or run.objective) and run.args.deepspeed:  # both read lm_head.weight in the forward
        gather_lm_head_with_model(model)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())  # ZeRO-3 shards
    n_trainable = None
    if adapters.enabled(r):
        model, n_trainable, n_all = adapters.wrap(model, r)
        run.say(f"peft {r.peft.method} r={r.peft.r} alpha={r.peft.alpha} on {r.peft.target_modules}"
                f"{' + full ' + str(r.peft.modules_to_save) if r.peft.modules_to_save else ''}: "
                f"{n_trainable:,} trainable of {n_all:,} parameters ({100 * n_trainable / n_all:.3f}%)")
    return model, n_params, n_trainable


def gather_lm_head_with_model(model) -> None:
    """Under ZeRO-3 with Liger: Liger's fused loss reads lm_head.weight without calling lm_head (liger_kernel 0.8.5
    transformers/model/llama.py:184-197, qwen3.py:104, gemma3.py:110). ZeRO-3 gathers such a read only inside the engine's forward, after it
    has seen one (deepspeed 0.19.8 runtime/zero/parameter_offload.py:71-88, engine.py:2953-2955); validation calls
    the module itself, and a job resumed at its last step runs no engine forward before it: the weight would be
    an empty partition there (Liger: ZeroDivisionError). Registered, it is gathered with the top module."""
    import deepspeed

    deepspeed.zero.register_external_parameter(model, model.get_output_embeddings().weight)


def build_trainer(r: Recipe, run: Run, model, n_params: int, stop):
    """The Trainer with zerotune's callbacks: safety policies, metrics, evaluation during training, signals,
    committed checkpoints, fault injection for tests. Returns (trainer, safety, metrics, commit callbacks)."""
    from transformers import Trainer

    cfg = model.config
    tokens = run.data_manifest["tokens"]
    safety = SafetyChecks()
    metrics = StepMetrics(run.paths.metrics, run.bp.global_batch_tokens, tokens["train_label"] / max(1, tokens["train_total"]),
                          flops_per_token(n_params, cfg.num_hidden_layers, cfg.hidden_size, r.data.seq_len),
                          hardware.peak_tflops(run.gpu, run.choice.precision), run.world, safety=safety)
    commit = CommitCheckpoints(r.train.save_total_limit, run.bp)
    objective = run.objective
    trainer_class, extra = ((objective.trainer_class, {"objective": objective}) if objective else
                            (SequenceParallelTrainer if r.train.sequence_parallel > 1 else Trainer, {}))
    trainer = trainer_class(model=model, args=run.args, train_dataset=run.train_ds, data_collator=run.collate,
                            # safety before metrics: a step or loss that stops the run is judged before it is logged;
                            # validation after CommitCheckpoints: a step is committed before it is validated
                            callbacks=[EndAtLastStep(), *(objective.callbacks(run, stop) if objective else ()), safety,
                                       metrics, stop, commit,
                                       evaluation := EvalDuringTraining(r, metrics, run.choice.liger, stop,
                                                                        measure=objective.validate if objective
                                                                        else None),
                                       *faults.callbacks(model)], **extra)
    safety.attach(trainer)
    evaluation.attach(trainer)
    if run.universal is not None:  # after DeepSpeed loaded the conversion: restore what it leaves out, and check
        trainer.add_callback(CheckUniversalLoad(trainer, run.universal, run.saved_world))
    if run.choice.liger and run.choice.precision == "fp16":  # Liger's fp16 lm_head gradient can overflow unscaled
        safety.watch_lm_head(model)
    metrics.attach(trainer)
    metrics.count_labels(model, (n_params, cfg.num_hidden_layers, cfg.hidden_size))  # tokens and FLOPs as they run
    metrics.watch_grads(model)  # fp16 underflow at large GA shows as zero gradient elements
    if getattr(trainer.accelerator, "scaler", None) is not None:  # fp16 without DeepSpeed: torch's GradScaler
        trainer.accelerator.scaler = ds_config.amp_grad_scaler(run.bp.grad_accum, run.steps)
    return trainer, safety, metrics, commit


def choose_resume(r: Recipe, run: Run, metrics):
    """The newest committed checkpoint (None: from the start); rank 0 drops later checkpoints and metric rows."""
    resume = last_committed(run.paths.checkpoints, quiet=run.rank != 0)
    run.barrier()  # every rank has chosen before rank 0 removes anything
    if run.rank == 0:
        run.paths.train.mkdir(parents=True, exist_ok=True)
        run.paths.stopped.unlink(missing_ok=True)
        discard_after(run.paths.checkpoints, resume)
        if resume is None:  # a fresh start: no earlier run's failed validation may excuse this run's
            run.paths.validation_failed.unlink(missing_ok=True)
        metrics.rewind(step_of(resume) if resume else 0)
        if resume:
            run.say(f"resuming from committed checkpoint {resume}")
    run.barrier()
    return resume


def train_or_stop(r: Recipe, run: Run, trainer, stop, commit, resume) -> float:
    """trainer.train; returns the seconds it took. A signal or the deadline ends the process here with
    REQUEUE_EXIT after writing stopped.json (a committed checkpoint, or none before the first step)."""
    import contextlib

    if run.universal is not None and run.universal.parent != resume:  # setup and choose_resume read the same files
        raise RuntimeError(f"resuming {resume}, but setup prepared {run.universal}")
    t0 = time.time()
    try:
        # another world size: the Trainer and DeepSpeed resume from the conversion, a complete resume folder
        with reshard.glob_safe(run.universal or resume) if resume else contextlib.nullcontext(None) as path:
            trainer.train(resume_from_checkpoint=str(path) if path else None)
    except TrainingComplete as e:  # the weights are loaded: what is left is the end of training, then finalize
        run.say(f"{e}: nothing left to train")
        trainer.control = trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
    except StopBeforeTraining as e:
        run.say(f"{e}: stopping without a new checkpoint; a rerun resumes from {resume or 'the beginning'}")
        if run.rank == 0:
            StopRecord(step_of(resume) if resume else 0, stop.requested, str(resume) if resume else None,
                       committed=False).write(run.paths.stopped)
        run.barrier()
        sys.exit(REQUEUE_EXIT)
    except UserError as e:  # e.g. a GRPO reward that raised: its one line is the handoff's (train/handoff.py)
        if run.rank == 0:
            print(describe_failure(e, run.paths.checkpoints, commit.saving, say_error=False), file=sys.stderr,
                  flush=True)
        raise
    except Exception as e:
        # every rank says it: the rank that failed first may be the only one left to print anything
        print(f"[rank {run.rank}] " + describe_failure(e, run.paths.checkpoints, commit.saving), file=sys.stderr,
              flush=True)
        fp16 = scaler_gave_up(e)
        if fp16 is not None:
            raise fp16 from e
        raise
    if stop.stopped_at is not None:
        if run.rank == 0:
            StopRecord(stop.stopped_at, stop.reason, str(last_committed(run.paths.checkpoints)),
                       committed=True).write(run.paths.stopped)
        run.barrier()
        sys.exit(REQUEUE_EXIT)
    return time.time() - t0


def save_for_finalize(r: Recipe, run: Run, trainer, n_params: int, n_trainable: int | None, elapsed: float) -> None:
    """The consolidated save into model.tmp/ with the handoff finalize needs (Probe, RunRecord); the last collective."""
    import torch
    import torch.distributed as dist

    # a short prefix of one row, logits kept in the training dtype: size bounded whatever seq_len (verify.py)
    probe = {k: v.to(run.args.device) for k, v in probe_inputs(run.probe_collate([run.train_ds[0]])).items()}
    with torch.no_grad():
        trainer.model_wrapped.eval()
        ref_logits = trainer.model_wrapped(**probe, use_cache=False).logits  # use_cache=False as finalize
        ref_logits = ref_logits.to(model_dtype(run.choice.precision)).cpu()
    tmp = run.paths.model_staging
    if run.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    run.barrier()
    trainer.save_model(str(tmp))  # ZeRO-3: gathers the 16-bit weights into one consolidated file on rank 0
    # (peft: save_model writes only the adapter; finalize merges it into the 16-bit base)
    if run.rank == 0:
        load_tokenizer(r).save_pretrained(tmp)
        Probe({k: v.cpu() for k, v in probe.items()}, ref_logits, n_params, run.choice.precision,
              n_trainable, run.choice.attention).save(tmp)
        RunRecord(world_size=run.world, device=run.gpu.name, data_fingerprint=run.data_manifest["fingerprint"],
                  choice={"precision": run.choice.precision, "attention": run.choice.attention,
                          "liger": run.choice.liger},
                  batch=run.bp.record(),
                  steps=run.steps, elapsed_s=round(elapsed, 1), base=str(run.paths.base)).write(run.paths.run_json)
    # What kept the trained model alive after training (issue 19): ZeRO-3's per-parameter gradient hooks
    # (deepspeed/runtime/zero/stage3.py:1525 -> deepspeed/utils/torch.py:42, register_post_accumulate_grad_hook)
    # live in a dict that torch stores on the C++ tensor (torch/_tensor.py:755-764), which gc does not traverse;
    # each hook's closure holds the ZeRO-3 optimizer, and through it the engine and the model: a cycle gc can
    # never free. accelerate's free_memory runs engine.destroy(), which removes those hooks and the module hooks;
    # it asks deepspeed.comm for the rank (stage3.py print_rank_0), so it runs while the group still exists.
    trainer.accelerator.free_memory()
    if dist.is_initialized():
        dist.barrier()  # the last collective: every rank has saved, rank 0 has written the probe
        dist.destroy_process_group()


def release_training_states(model_ref) -> None:
    """Drop what keeps the trained model (and through its hooks the Trainer) alive after training, so finalize
    does not run beside rank 0's share of the training states. The hooks that held it from C++ are gone
    already (save_for_finalize: engine.destroy; worker: the callbacks' detach); what is left are module globals."""
    import gc

    import torch

    rss0, gpu0 = _rss_gb(), torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
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
    _malloc_trim()
    mem = f"rank 0 RSS {rss0:.2f} -> {_rss_gb():.2f} GB" if rss0 is not None else "rank 0 RSS unknown"
    if gpu0 is not None:
        mem += f", GPU allocated {gpu0:.2f} -> {torch.cuda.memory_allocated() / 2**30:.2f} GiB"
    if model_ref() is None:  # tests/test_train_integration.py checks this line
        print(f"finetune: training states released ({mem}); finalizing", flush=True)
    else:  # a new holder: walk gc.get_referrers up from the model to an object gc cannot see all holders of
        # (a refcount above its gc-visible referrers: a C++ hook) or to a module global
        print(f"finetune: the trained model is still referenced after training (rank 0's share of the training "
              f"states stays allocated: {mem}); finalizing beside it", flush=True)


def _rss_gb() -> float | None:
    """This process's resident memory (Linux /proc), in GB; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 / 1e9 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def _malloc_trim() -> None:
    """glibc keeps freed heap pages mapped in this process; hand them back for the finalize child (SmolLM2 on 2
    CPU ranks, rank 0: 2.96 GB at the handoff, 2.07 GB after malloc_trim alone, 0.75 GB after the release)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


def start_finalize(run_dir) -> None:
    """Verify and publish in a fresh process: reloading here would run ZeRO-3 collectives, and the same step
    must run whether torchrun was started by `zerotune finetune` or by sbatch."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["OMP_NUM_THREADS"] = str(job_cpus())  # the launcher set 1 per training rank; finalize is alone now
    subprocess.check_call([sys.executable, "-m", "zerotune.train", "finalize", str(run_dir)], env=env)
