"""The recipe on its target cluster, resolved once: the model's shape, the GPU and how many, hardware.choose's
decision, the resolved ZeRO settings, the capacity per GPU and the prepared data's document lengths. Every part
of the plan (compute.py, options.py, nodes.py) asks a `Target` for memory and step time at some rows and world
size, instead of threading a dozen arguments through each call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import batch as batchmod
from .. import ds_config, hardware
from .. import manifest as mf
from ..config import Recipe, check_sequence_parallel_heads
from ..errors import UserError
from ..layout import layout
from . import time as timemodel
from .flops import flops_per_step
from ..hub import ModelConfigError, config_source
from .memory import GiB, ModelShape, memory_breakdown, peft_trainable_params, shape_of, ulysses_kv_dim
from .phases import phase_plan
from .records import FixedParts, MicroStep, Phases, StepTime, Terms


class PlanError(UserError, RuntimeError):
    """The recipe is predicted not to fit its target; the message says why and what to change."""


SAVE_BYTES_PER_S = 1e9  # assumed checkpoint write rate to shared storage, all ranks together: measure your own


@dataclass(frozen=True)
class Target:
    r: Recipe
    shape: ModelShape
    gpu: str                 # a key of hardware.GPUS
    g: hardware.GPU
    gpus_per_node: int
    nodes: int
    choice: hardware.Choice
    zero: dict | None        # the resolved zero_optimization (ds_config.build); None without DeepSpeed
    accum_bytes: int | None  # DeepSpeed's gradient accumulation dtype (None: the model's)
    capacity: int            # bytes per GPU (a CPU target: the node's RAM per process)
    cluster: str | None      # a key of planner/time.py CLUSTERS: the links between the GPUs
    docs: dict | None        # the prepared data's document lengths (None before `make data`)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def on_gpu(self) -> bool:
        return self.g.capability is not None

    @property
    def zero_stage(self) -> int:
        return int((self.zero or {}).get("stage", 0) or 0)

    @property
    def offload_optimizer(self) -> bool:
        return ((self.zero or {}).get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")

    @property
    def hpz(self) -> int:
        return int((self.zero or {}).get("zero_hpz_partition_size", 1) or 1)

    @property
    def peft(self) -> tuple[str, int] | None:
        """(method, trainable parameters), or None for full fine-tuning."""
        p = self.r.peft
        if p.method == "none":
            return None
        return p.method, peft_trainable_params(self.shape, p.r, p.target_modules, p.modules_to_save)

    @property
    def trainable(self) -> int:
        return self.peft[1] if self.peft else self.shape.n_params

    @property
    def mfu(self) -> float | None:
        return self.r.plan.mfu or self.g.default_mfu

    @property
    def timed(self) -> bool:
        """Whether the time model has figures for this target (a CPU target has none)."""
        return bool(self.mfu and self.g.peak_tflops and self.cluster)

    def row_tokens(self, seq: int) -> tuple[float, str | None]:
        """(tokens a row carries on average, where that comes from; None: the row is seq_len, packed). DPO's pairs are
        padded to their own longer row (preference/objective.py collate), not to seq_len: the prepared data's mean
        once `make data` has measured it, the seq_len bound before."""
        if not self.r.pairs:
            return float(seq), None
        if self.docs and self.docs.get("pair_row"):
            return min(float(self.docs["pair_row"]), seq), "the prepared pairs' mean padded row (data manifest)"
        return float(seq), "the data.seq_len bound until `make data` measures the pairs"

    def rows(self, micro: int) -> int:
        """A micro-batch's rows, the planner's unit: a DPO pair's chosen and rejected rows count two."""
        return micro * batchmod.rows_per_sample(self.r)

    @property
    def sp(self) -> int:
        """The recipe's sequence-parallel degree: ranks sharing one row."""
        return self.r.train.sequence_parallel

    def grad_accum(self, seq: int, rows: int, world: int | None = None, sp: int | None = None) -> int:
        """Micro-batches per optimizer step over the data-parallel ranks (world / sp)."""
        return batchmod.grad_accum(self.r.train.global_batch_tokens, seq, rows, (world or self.world) // (sp or self.sp))

    def memory(self, seq: int, rows: int, *, choice: hardware.Choice | None = None, zero: dict | None = None,
               gpus_per_node: int | None = None, nodes: int | None = None, sp: int | None = None) -> dict:
        """The training step's per-GPU memory (memory.memory_breakdown) at `rows` x `seq`, each row shared by `sp`
        ranks (default: the recipe's); the keywords try a switch (options.suggestions) or another cluster size
        (nodes.py)."""
        r, ch = self.r, choice or self.choice
        sp = sp or self.sp
        zero = self.zero if zero is None else zero
        gpn, nodes = gpus_per_node or self.gpus_per_node, nodes or self.nodes
        return memory_breakdown(
            self.shape, seq=seq, micro=rows, precision=ch.precision, attention=ch.attention, liger=ch.liger,
            checkpointing=r.train.gradient_checkpointing, packing=r.data.packing, zero=zero, gpus_per_node=gpn,
            nodes=nodes, gpu_is_cuda=self.on_gpu, peft=self.peft, capability=self.g.capability,
            lm_head_trainable=r.peft.method == "none" or "lm_head" in r.peft.modules_to_save,
            grad_accum_bytes=self.accum_bytes, grad_accum=self.grad_accum(seq, rows, gpn * nodes, sp),
            # DPO's and GRPO's fused loss (preference/loss.py FusedTokenLoss): no sequence x vocabulary logits
            preference_chunk=(r.preference.chunk_tokens if r.pairs else r.rl.chunk_tokens if r.grpo else None),
            sequence_parallel=sp, reference_copy=self.reference_copy)

    @property
    def kl_reference(self) -> str | None:
        """GRPO with a KL term: what computes the starting model's log-probs (rl/objective.py reference_logps):
        "adapters_off" (LoRA: the policy itself), "copy" (full fine-tuning: a frozen copy on every GPU), else None."""
        r = self.r
        if not (r.grpo and r.rl.beta > 0):
            return None
        return "adapters_off" if self.peft else "copy"

    @property
    def reference_copy(self) -> int:
        """The KL's frozen copy of the starting model on every GPU, in the model's dtype (bytes; 0 without one)."""
        return hardware.dtype_bytes(self.choice.precision) * self.shape.n_params if self.kl_reference == "copy" else 0

    def phases(self, mem: dict, seq: int | None = None, rows: int | None = None, hpz: int | None = None) -> Phases:
        """Every phase of the job at `rows` x `seq` (default: the recipe's own batch) on this target (planner/phases.py);
        mem: the training step's memory_breakdown at that batch. Under ZeRO-3, the generating phases gather the whole
        model once where it fits (gather_once), beside hpZ's secondary copy where `hpz` (default: the recipe's) has one."""
        r = self.r
        sets = r.eval_sets()  # in-training samples answer the first set's prompts (validation._sample_prompts)
        seq = seq or r.data.seq_len
        rows = rows or self.rows(r.train.micro_batch_size)
        return self._gather_once(phase_plan(
            m=self.shape, train=mem, precision=self.choice.precision, attention=self.choice.attention,
            liger=self.choice.liger, packing=r.data.packing, zero=self.zero, world=self.world,
            gpus_per_node=self.gpus_per_node, on_gpu=self.on_gpu, seq=seq, micro=rows,
            # the step's micro-batches still bound on the GPU between steps: none under sequence
            # parallelism, whose adapter keeps its slices on the host (memory.memory_breakdown)
            grad_accum=self.grad_accum(seq, rows) if self.sp == 1 else 0, trainable=self.trainable, peft=self.peft,
            gpu_capacity=self.capacity, host_capacity=int(r.plan.cpu_ram_gb * 1e9),
            validation_runs=r.data.eval_fraction > 0, samples=r.eval.samples if sets else 0,
            max_new_tokens=sets[0].max_new_tokens if sets else 0, quant_type=r.quantize.type,
            preference_chunk=r.preference.chunk_tokens if r.pairs else None,
            rollout=self.rollout_shape(seq, rows) if r.grpo else None, rollout_chunk=r.rl.chunk_tokens,
            kl_reference=self.kl_reference), self.hpz if hpz is None else hpz)

    def rollout_shape(self, seq: int, rows: int) -> tuple[int, int, int]:
        """A GRPO micro-step's generate(): (rows = micro prompts x G, the prompt bound, the tokens sampled). A prompt
        and its completion fit in a row (rl/objective.py caps the completion at seq_len - the longest prompt)."""
        new = self.r.rl.max_new_tokens
        return rows, seq - new, new

    def _gather_once(self, phases: Phases, hpz: int) -> Phases:
        """In-training samples and GRPO's rollouts under ZeRO-3 across ranks: gather the whole model once per
        generate() call (gathering.py, as TRL's unwrap_model_for_generation does) when it fits beside the phase's
        own peak, instead of once per generated token. Where it fits, the phase holds the 16-bit model too; where it
        does not (one 8xV100 node at 8B), per-token gathers stay, over the node's NVLink. The rule is the run's
        (Phase.room_to_gather_once), with the room the phase leaves beside generate() as the free memory."""
        e = hardware.dtype_bytes(self.choice.precision)
        whole = e * self.shape.n_params
        # ZeRO++ hpZ's secondary copy of the parameters stays on the GPU through every phase (not in the phases'
        # parts: compute.warnings HpzCopy), so it takes from the room too
        secondary = timemodel.hpz_bytes(self.shape.n_params, e, hpz)
        changed = {}
        for name in ("samples", "rollout"):
            s = getattr(phases, name)
            if s is None or self.world == 1 or not s.room_to_gather_once(
                    self.capacity - (s.peak_bytes - s.generating_bytes) - secondary, whole):
                continue
            changed[name] = dataclasses.replace(s, parts={**s.parts, "whole model gathered once (16-bit)": whole},
                                                peak_bytes=s.peak_bytes + whole, gather_once=True,
                                                what=s.what + "; the whole model gathered once per generate()")
        return dataclasses.replace(phases, **changed)

    def forwards(self, world: int | None = None, cluster: str | None = None) -> timemodel.Model:
        """What a no-grad forward costs on this target at `world` GPUs (validation, samples, rollouts)."""
        world = world or self.world
        return timemodel.Model(
            n_params=self.shape.n_params, layers=self.shape.layers, q_dim=self.shape.q_dim,
            dtype_bytes=hardware.dtype_bytes(self.choice.precision), world=world, nodes=world // self.gpus_per_node,
            c=timemodel.CLUSTERS[cluster or self.cluster], peak_tflops=hardware.peak_tflops(self.g, self.choice.precision),
            mfu=self.mfu, module_numels=self.shape.zero3_modules(self.zero)[0],
            host_pass_s=timemodel.zero3_host_pass_s(self.zero_stage, self.shape.layers, self.peft is not None))

    def rollout_time(self, seq: int, rows: int, world: int | None = None, cluster: str | None = None,
                     hpz: int | None = None) -> dict | None:
        """GRPO: the rollouts of one optimizer step at `rows` x `seq` on `world` GPUs (time.rollout_time), gathered
        once or per token as the rollout phase's memory at that world size allows; None for other objectives or a
        target without time figures. Part of every step time (step_time), so the node table, the choices and the
        preemption arithmetic count it."""
        if not (self.r.grpo and self.timed):
            return None
        world = world or self.world
        at = dataclasses.replace(self, nodes=world // self.gpus_per_node)
        once = at.phases(at.memory(seq, rows), seq, rows, hpz).rollout.gather_once
        return timemodel.rollout_time(self.forwards(world, cluster), *self.rollout_shape(seq, rows),
                                      micro_steps=self.grad_accum(seq, rows, world), gather_once=once,
                                      reference=self.kl_reference)

    def step_time(self, seq: int, rows: int, world: int | None = None, *, hpz: int | None = None,
                  cluster: str | None = None, sp: int | None = None) -> StepTime:
        """FLOPs per optimizer step and, where the time model has figures, the seconds it takes: compute at the
        assumed MFU (the kernels' efficiency alone) + the communication it cannot hide + the optimizer step + fixed
        costs (planner/time.py)."""
        world, sp = world or self.world, sp or self.sp
        row, row_from = self.row_tokens(seq)
        f = flops_per_step(self.r, self.shape, seq, rows, self.choice.attention, self.docs, row)
        flops = StepTime(tokens_per_step=f["tokens_per_step"], row_tokens_from=row_from,
                         flops_per_step=f["flops_per_step"], flops_dense=f["flops_dense"],
                         flops_recompute=f["flops_recompute"], flops_attention=f["flops_attention"],
                         attention_kind=f["attention_kind"], attention_span=f["attention_span"],
                         attention_span_from=f["attention_span_from"], mfu=self.mfu)
        if not self.timed:
            return flops
        c = timemodel.CLUSTERS[cluster or self.cluster]
        job = self._job(f["flops_per_step"], seq, rows, world, hpz, sp, row)
        rollout = self.rollout_time(seq, rows, world, cluster, hpz)
        if rollout:
            job = dataclasses.replace(job, rollout_s=rollout["seconds"],
                                      prefetch="all" if self.zero_stage != 3 or world == 1 else
                                      "none" if rollout["gather_once"] else "forward")
        # fp32 (Gemma 3 on V100): its own peak
        t = timemodel.step_time(job, c, hardware.peak_tflops(self.g, self.choice.precision), self.mfu)
        return dataclasses.replace(
            flops, seconds_per_step=t["seconds_per_step"], grad_accum=job.grad_accum, terms=Terms(**t["terms"]),
            dominant=t["dominant"], per_micro_step=MicroStep(**t["per_micro_step"]),
            step_communication_s=t["step_communication_s"],
            communication_over_compute=t["communication_over_compute"], crossover_tokens=t["crossover_tokens"],
            optimizer_how=t["optimizer_how"], fixed_parts=FixedParts(**t["fixed_parts"]), overlap=t["overlap"],
            prefetch=t["prefetch"],
            cluster=t["cluster"], cluster_describe=c.describe, inter_node_gbs=t["inter_node_gbs"],
            intra_node_gbs=t["intra_node_gbs"])

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint: the fp32 master weights and Adam m, v of the trainable parameters (12 B each, split over
        ranks) plus the Trainer's own save of the model (the gathered 16-bit weights, or the adapter)."""
        return (12 + hardware.dtype_bytes(self.choice.precision)) * self.trainable

    @property
    def save_s(self) -> float:
        return self.checkpoint_bytes / SAVE_BYTES_PER_S

    def _job(self, flops: float, seq: int, rows: int, world: int, hpz: int | None, sp: int,
             row: float) -> timemodel.Job:
        gpn, m = self.gpus_per_node, self.shape
        ga = self.grad_accum(seq, rows, world, sp)
        numels, bucket = m.zero3_modules(self.zero)
        e = hardware.dtype_bytes(self.choice.precision)
        tokens = int(row * rows) // sp  # this GPU's slice of its micro-batch's rows (DPO: as padded, row_tokens)
        recompute = self.r.train.gradient_checkpointing
        return timemodel.Job(n_params=m.n_params, trainable=self.trainable,
                             flops_micro=flops / (world * ga),  # a row's FLOPs divide over its sp ranks
                             forward_share=0.25 if recompute else 1 / 3,
                             tokens_micro=tokens, grad_accum=ga, gpus_per_node=gpn, nodes=world // gpn,
                             dtype_bytes=e, zero_stage=self.zero_stage,
                             offload_optimizer=self.offload_optimizer, hpz=self.hpz if hpz is None else hpz,
                             save_s=self.save_s, save_steps=self.r.train.save_steps,
                             module_numels=numels, reduce_bucket=bucket, sequence_parallel=sp,
                             ulysses_bytes=e * tokens * (2 * m.q_dim + 2 * ulysses_kv_dim(m, sp)),
                             layers=m.layers, passes=3 if recompute else 2, adapters=self.peft is not None)


def resolve(r: Recipe, gpu: str | None = None, gpus_per_node: int | None = None, nodes: int | None = None,
            cluster: str | None = None) -> Target:
    """The recipe on its `plan:` cluster, or on the one the arguments name."""
    name = gpu or r.plan.gpu
    if name not in hardware.GPUS:
        raise PlanError(f"plan.gpu '{name}' unknown; choose one of {sorted(hardware.GPUS)}.")
    if cluster is not None and cluster not in timemodel.CLUSTERS:
        raise PlanError(f"cluster '{cluster}' unknown; choose one of {sorted(timemodel.CLUSTERS)}.")
    g = hardware.GPUS[name]
    gpn = gpus_per_node or r.plan.gpus_per_node
    try:
        shape = model_shape(r)
    except ModelConfigError as e:
        raise PlanError(str(e)) from None
    check_sequence_parallel_heads(r, shape.heads, shape.kv_heads)
    # Planning for the cluster, not this machine: assume flash-attn is installed where it can be.
    fa2 = g.capability is not None and g.capability >= (8, 0)
    choice = hardware.choose(g, r.train.precision, r.train.attention, r.train.liger, fa2_installed=fa2,
                             family=shape.fam)  # the family's own precision limits (families.py)
    ds = ds_config.build(r)
    zero = ds.get("zero_optimization") if ds else None
    accum = hardware.PRECISION_BYTES.get(((ds or {}).get("data_types") or {}).get("grad_accum_dtype"))
    if g.capability is None:  # CPU target: every process shares the node's RAM
        capacity = int(r.plan.cpu_ram_gb * 1e9 / gpn)
    else:
        capacity = int(g.usable_gib * GiB)  # the total PyTorch reports (hardware.GPU.usable_gib)
    return Target(r=r, shape=shape, gpu=name, g=g, gpus_per_node=gpn, nodes=nodes or r.plan.nodes, choice=choice,
                  zero=zero, accum_bytes=accum, capacity=capacity, cluster=cluster or g.cluster,
                  docs=doc_lengths(r))


def model_shape(r: Recipe) -> ModelShape:
    """The recipe's model, from its config.json wherever it is (hub.config_source), without loading weights."""
    return shape_of(str(config_source(r)))


def doc_lengths(r: Recipe) -> dict | None:
    """The prepared data's document lengths (p50, p99, ...), its attention span and the seq_len it was packed at."""
    man = mf.read(layout(r).data_manifest)
    if not man:
        return None
    return {**(man.get("doc_length") or {}), "attention_span": man.get("attention_span"),
            "seq_len": (man.get("packing") or {}).get("seq_len"),
            "pair_row": (man.get("pairs") or {}).get("padded_row_tokens_mean"),
            "label_tokens_per_row": (man.get("tokens") or {}).get("train_label", 0) / max(1, (
                2 if r.pairs else 1) * (man.get("sequences") or {}).get("train", 0)) or None}
