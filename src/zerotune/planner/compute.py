"""The plan of a training job, computed once: will it fit, how long will it take (`zerotune plan`, preflight).

Everything is computed for the recipe's target cluster (`plan:`), not for this machine, so a laptop can plan a V100
job. Memory per GPU comes from memory.py (DeepSpeed's estimator for model states + modelled buffers and activations)
for the training step, and from phases.py for every other phase of the job (validation, samples, save, resume,
finalize, quantize); disk per event from disk.py; time per optimizer step from time.py (compute at an assumed MFU,
the communication it cannot hide, the optimizer step, fixed costs), on 1-8 nodes (nodes.py). Before the job,
data.replay's answering in the data step (replay.py): reported, never refused by preflight (it has run by the time
finetune starts).

`compute_plan` returns a typed `Plan` (records.py); report.py prints it, gate.py refuses a launch it says will not
fit. A launch computes it once (train/launch.py before_launch, slurm/job.py) and hands it to every check that needs
it; plan.json carries it to the workers (`Plan.read`).
"""

from __future__ import annotations

import dataclasses
import math

from .. import batch as batchmod
from .. import hardware
from .. import manifest as mf
from ..config import Recipe
from ..layout import layout
from ..quant_types import QUANT_TYPES
from ..stopping import seconds_needed
from . import time as timemodel
from .disk import disk_events, held, world_size_change
from .nodes import node_table
from .options import options, recommend, suggestions
from .records import (Cluster, DataSteps, Disk, DiskEvent, FewSteps, FinalizeHostRam, Held, HpzCopy, Inference,
                      Memory, ModelSummary, OffloadHostRam, OffloadTime, OffloadUnmodelled, Phases, PhaseTime, Plan,
                      Preemption, QuantFit, RecipeBatch, StepTime, Views, WorldSizeChange)
from .replay import plan_replay
from .target import SAVE_BYTES_PER_S, Target, resolve

MIN_STEPS = 20  # below this, warmup/cosine schedules and loss curves mean little
# GGUF types the plan sizes for the T4 (bits per weight from the one quantization table)
PLANNED_QUANTS = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
T4 = hardware.GPUS["t4"]


def compute_plan(r: Recipe, gpu: str | None = None, gpus_per_node: int | None = None, nodes: int | None = None,
                 cluster: str | None = None) -> Plan:
    """cluster: a cluster type of planner/time.py CLUSTERS (links between the GPUs); default: the GPU's."""
    t = resolve(r, gpu, gpus_per_node, nodes, cluster)
    rows = t.rows(r.train.micro_batch_size)
    mem = t.memory(r.data.seq_len, rows)
    memory = memory_record(t, mem)
    batch = recipe_batch(t, memory.peak_bytes)
    data = data_steps(t, batch)
    disk = plan_disk(t, data.total_steps)
    time = t.step_time(r.data.seq_len, rows)
    if time.seconds_per_step and t.g.cluster and t.zero_stage == 3:  # multi-node = ZeRO-3 here
        time = dataclasses.replace(time, nodes=node_table(t))
    phases = with_times(t, t.phases(mem), time, disk, data)
    opts = options(t)
    rec = recommend(t, opts)
    replay, replay_error = plan_replay(t)
    return Plan(recipe=r.name, model=model_summary(t),
                cluster=Cluster(gpu=t.gpu, gpu_name=t.g.name, gpus_per_node=t.gpus_per_node, nodes=t.nodes,
                                world_size=t.world, capacity_bytes=t.capacity),
                choice=t.choice, recipe_batch=batch, memory=memory, options=opts, recommended=rec,
                suggestions=() if rec else suggestions(t), phases=phases, time=time, data=data,
                inference=inference(t), disk=disk, preemption=preemption(t, time),
                replay=replay, replay_error=replay_error, warnings=warnings(t, memory, data, time, phases))


# ---------------------------------------------------------------------------------------------
# The recipe's own step
# ---------------------------------------------------------------------------------------------


def model_summary(t: Target) -> ModelSummary:
    s = t.shape
    return ModelSummary(config=s.config_path, n_params=s.n_params, largest_layer_params=s.largest_layer_params,
                        hidden=s.hidden, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                        intermediate=s.intermediate, vocab=s.vocab, max_positions=s.max_positions, family=s.family,
                        layer_types=s.layer_types, sliding_window=s.sliding_window, tied=s.tied,
                        gathered_modules=len(s.zero3_modules(t.zero)[0]) if t.zero_stage == 3 else 0)


def recipe_batch(t: Target, peak: int) -> RecipeBatch:
    r = t.r
    try:
        bp = batchmod.of_recipe(r, t.world)
        ga, error = bp.grad_accum, None
    except batchmod.BatchError as e:
        ga, error = None, str(e)
    return RecipeBatch(seq_len=r.data.seq_len, micro_batch_size=r.train.micro_batch_size, grad_accum=ga,
                       batch_error=error, global_batch_tokens=r.train.global_batch_tokens,
                       fits=peak <= t.capacity and not error, rows_per_sample=batchmod.rows_per_sample(r),
                       sequence_parallel=t.sp)


def memory_record(t: Target, mem: dict) -> Memory:
    return Memory(parts=mem["parts"], peak_bytes=mem["peak"], capacity_bytes=t.capacity, views=Views(**mem["views"]),
                  model_states_how=mem["model_states_how"], logits_how=mem["logits_how"],
                  cpu_bytes_per_node=mem["cpu_bytes_per_node"], sm70_delta_bytes=mem["sm70_delta_bytes"],
                  mlp_saved_bytes=mem["mlp_saved_bytes"])


def data_steps(t: Target, batch: RecipeBatch) -> DataSteps:
    """The run's optimizer steps from the prepared sequences, counted as the worker counts them (BatchPlan)."""
    r = t.r
    man = mf.read(layout(r).data_manifest)
    if not man or "sequences" not in man or batch.grad_accum is None:
        return DataSteps()
    bp = batchmod.of_recipe(r, t.world)
    n = man["sequences"]["train"]
    return DataSteps(train_sequences=n, eval_sequences=man["sequences"].get("eval"),
                     sequences_per_step=bp.sequences_per_step, steps_per_epoch=bp.steps_per_epoch(n),
                     total_steps=bp.total_steps(n, r.train.max_steps, r.train.epochs),
                     label_tokens_per_row=(t.docs or {}).get("label_tokens_per_row"))


# ---------------------------------------------------------------------------------------------
# Every phase of the job
# ---------------------------------------------------------------------------------------------


def with_times(t: Target, phases: Phases, time: StepTime, disk: Disk, data: DataSteps) -> Phases:
    """Each non-training phase's seconds once on the target cluster (time.phase_times); unchanged where the time
    model has no figures (a CPU target)."""
    if not t.timed:
        return phases
    r = t.r
    sets = r.eval_sets()
    seq = r.data.seq_len
    if r.pairs:  # DPO's rows as they run (padded to the pair's longer row), not the seq_len bound: Target.row_tokens
        seq = int(t.row_tokens(seq)[0])
    span = time.attention_span or (seq / 2 if time.attention_kind == "causal" else seq)
    rows = t.rows(r.train.micro_batch_size)
    times = timemodel.phase_times(
        t.forwards(), seq=seq, attention_span=span,
        eval_rows=t.rows(data.eval_sequences or 0) if r.data.eval_fraction > 0 else 0,
        samples=r.eval.samples if sets else 0, prompt_tokens=seq,  # the memory phase's bound: prompts <= a row
        new_tokens=sets[0].max_new_tokens if sets else 0, checkpoint_bytes=disk.checkpoint_bytes,
        model_bytes=disk.model_bytes, save_s=t.save_s, gather_once=phases.samples.gather_once,
        # DPO: a micro-batch's rows per no-grad forward; the reference pass: every pair's 2 rows (None: no data yet)
        rows_per_forward=rows if r.pairs else 1,
        reference_rows=t.rows(data.train_sequences + (data.eval_sequences or 0))
        if r.pairs and data.train_sequences is not None else None)
    if r.grpo:  # the same seconds the step time counts (Target.step_time)
        rollout = t.rollout_time(r.data.seq_len, rows)
        times["rollout"] = {k: v for k, v in rollout.items() if k != "gather_once"}  # the phase's own gather_once
    timed = {name: dataclasses.replace(getattr(phases, name), time=PhaseTime(**v)) for name, v in times.items()
             if getattr(phases, name) is not None}
    return dataclasses.replace(phases, **timed)


# ---------------------------------------------------------------------------------------------
# Disk, preemption, inference
# ---------------------------------------------------------------------------------------------


def plan_disk(t: Target, total_steps: int | None) -> Disk:
    """Bytes on the shared file system: each checkpoint (Target.checkpoint_bytes); finalize stages the published
    model beside them. Per event, counting the committed checkpoints this run already holds: planner/disk.py."""
    r = t.r
    w = hardware.dtype_bytes(t.choice.precision)
    model = w * t.shape.n_params
    paths = layout(r)
    now = held(paths.checkpoints, paths.model_staging)
    d = disk_events(checkpoint_bytes=t.checkpoint_bytes, model_bytes=model,
                    adapter_bytes=w * t.trainable if t.peft else None, save_total_limit=r.train.save_total_limit,
                    save_steps=r.train.save_steps, total_steps=total_steps, now=now)  # total_steps: None before data
    # ZeRO-3 partitions the optimizer by rank: another world size converts
    change = world_size_change(t.trainable, t.world, t.gpus_per_node) if t.zero_stage == 3 else None
    return Disk(checkpoint_bytes=t.checkpoint_bytes, model_bytes=model,
                events=tuple(DiskEvent(**e) for e in d["events"]), peak_bytes=d["peak_bytes"],
                checkpoints_at_once=d["checkpoints_at_once"],
                held=Held(**{**now, "checkpoint_steps": tuple(now["checkpoint_steps"])}),
                events_now=tuple(DiskEvent(**e) for e in d["events_now"]), needed_free_bytes=d["needed_free_bytes"],
                needed_at=d["needed_at"], world_size_change=WorldSizeChange(**change) if change else None)


def preemption(t: Target, time: StepTime) -> Preemption:
    """What a time limit or a kill costs under slurm/finetune.sbatch. At a time limit the workers stop at a step
    boundary with a commit when the next step + save + margin would not fit (stopping.out_of_time): no trained
    step is lost, up to that much of the allocation goes unused. A kill without warning loses the steps since
    the last save. The USR1 lead must cover at least one save (the step in flight is finished first)."""
    step, save = time.seconds_per_step, t.save_s
    every = t.r.train.save_steps if t.r.train.save_steps > 0 else None
    return Preemption(save_s=save, save_bytes_per_s=SAVE_BYTES_PER_S,
                      signal_lead_s=60 * math.ceil(seconds_needed(0, save) / 60),
                      idle_at_time_limit_s=seconds_needed(step, save) if step else None,
                      lost_on_kill_s=every * step if step and every else None, save_steps=every)


def inference(t: Target) -> Inference:
    s = t.shape
    kv_per_token = hardware.kv_bytes_per_token(s.layers, s.kv_heads, s.head_dim)
    fits = []
    for q in PLANNED_QUANTS:
        size = s.n_params * QUANT_TYPES[q].bpw / 8
        ctx = hardware.llama_cpp_fit(T4, size, kv_per_token, 0, s.max_positions)["max_context_that_fits"]
        fits.append(QuantFit(quant=q, gguf_bytes=int(size), t4_fits=ctx >= 512, t4_max_context=ctx))
    return Inference(kv_bytes_per_token=kv_per_token, t4_usable_gib=T4.usable_gib, quant=tuple(fits),
                     recipe_quant=t.r.quantize.type)


# ---------------------------------------------------------------------------------------------
# Warnings: the numbers (report.py has the words)
# ---------------------------------------------------------------------------------------------


def warnings(t: Target, memory: Memory, data: DataSteps, time: StepTime, phases: Phases) -> tuple:
    r, out = t.r, []
    if data.total_steps is not None and data.total_steps < MIN_STEPS:
        out.append(FewSteps(total_steps=data.total_steps, train_sequences=data.train_sequences,
                            sequences_per_step=data.sequences_per_step, epochs=r.train.epochs, min_steps=MIN_STEPS))
    if t.offload_optimizer:
        if time.terms:
            out.append(OffloadTime(optimizer_s=time.terms.optimizer,
                                   pcie_s=time.per_micro_step.offload_grad_pcie_s or 0.0,
                                   compute_s=time.per_micro_step.compute_s,
                                   tokens_micro=r.data.seq_len * r.train.micro_batch_size, world=t.world))
        else:
            out.append(OffloadUnmodelled())
        if memory.cpu_bytes_per_node > r.plan.cpu_ram_gb * 1e9:
            out.append(OffloadHostRam(need_bytes=memory.cpu_bytes_per_node, cpu_ram_gb=r.plan.cpu_ram_gb))
    if t.hpz > 1:
        extra = timemodel.hpz_bytes(t.shape.n_params, hardware.dtype_bytes(t.choice.precision), t.hpz)
        out.append(HpzCopy(hpz=t.hpz, extra_bytes=extra, peak_bytes=memory.peak_bytes + extra, capacity_bytes=t.capacity))
    fin = phases.finalize
    if not fin.fits:
        out.append(FinalizeHostRam(peak_bytes=fin.peak_bytes, cpu_ram_gb=r.plan.cpu_ram_gb, merge=t.peft is not None))
    return tuple(out)
