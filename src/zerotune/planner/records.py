"""The plan as typed records: what `compute_plan` predicts, what report.py prints, what gate.py refuses on, and
what plan.json holds for every process that reads it later (the launcher's workers, validation's deadline).

Every record is a frozen dataclass; `Plan.to_json()` writes them as plain JSON and `Plan.read(path)` builds them
back, field by field from the annotations below, so a reader of plan.json and the planner see the same names and
a renamed field is a diff every reader meets. The words a person reads (warnings, advice, suggestions) are not
here: each record holds the numbers, report.py says them.

Imports only hardware's Choice from zerotune: a worker that reads the plan does not load the planner.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..hardware import Choice  # hardware.choose's decision for the target GPU, and why

# ---------------------------------------------------------------------------------------------
# The model, the cluster, the choices
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSummary:
    """The shape the plan was computed for (planner/memory.py ModelShape, without its per-module table)."""
    config: str
    n_params: int
    largest_layer_params: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    family: str
    layer_types: tuple[str, ...]
    sliding_window: int | None
    tied: bool
    gathered_modules: int  # ZeRO-3: modules gathered one collective each (0 unless stage 3)


@dataclass(frozen=True)
class Cluster:
    gpu: str          # a key of hardware.GPUS
    gpu_name: str     # as a person names it
    gpus_per_node: int
    nodes: int
    world_size: int
    capacity_bytes: int  # per GPU (a CPU target: the node's RAM per process)


@dataclass(frozen=True)
class RecipeBatch:
    """The recipe's own rows and batch on the target: GA derived, or why it cannot be."""
    seq_len: int
    micro_batch_size: int
    grad_accum: int | None
    batch_error: str | None
    global_batch_tokens: int
    fits: bool           # memory fits and the batch is exact
    rows_per_sample: int  # 2 for a DPO pair (a chosen and a rejected row)
    sequence_parallel: int = 1  # ranks sharing each row: each GPU holds seq_len / N of its tokens

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.grad_accum is None else self.seq_len * self.micro_batch_size * self.grad_accum


# ---------------------------------------------------------------------------------------------
# Memory, per phase
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Views:
    """A peak as each tool reports it (calibration.views): max_memory_allocated, max_memory_reserved, nvidia-smi."""
    allocated: int
    reserved: int
    nvidia_smi: int


@dataclass(frozen=True)
class Memory:
    """The training step's per-GPU memory: named parts (in the order they are printed) and their sum."""
    parts: dict[str, int]
    peak_bytes: int
    capacity_bytes: int
    views: Views
    model_states_how: str
    logits_how: str
    cpu_bytes_per_node: int  # what DeepSpeed's estimator puts in host RAM (offload)
    sm70_delta_bytes: int = 0  # a V100's attention backward: fp32 dO, O and their product (memory.py)
    mlp_saved_bytes: int = 0   # what one layer's MLP saved, freed before its attention's backward

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class PhaseTime:
    """A phase's seconds once on the target cluster (planner/time.py phase_times); None: not known yet (rows not
    counted before `make data`). The per-unit figures say what it is made of."""
    seconds: float | None
    per_row_s: float | None = None     # validation, reference: one row's forward
    rows_per_rank: int | None = None
    per_token_s: float | None = None   # samples, rollout: one new token (rollout: for all the micro-batch's rows)
    prompts: int | None = None
    new_tokens: int | None = None
    per_micro_step_s: float | None = None  # rollout: one micro-batch's generate() (seconds: per optimizer step)
    rows: int | None = None                # rollout: completions sampled per micro-step on one rank
    reference_s: float | None = None       # rollout with GRPO's KL: the copy's forward of them, in per_micro_step_s


@dataclass(frozen=True)
class Phase:
    """One phase's peak at its worst instant, against its device (a GPU, or the host's RAM)."""
    peak_bytes: int
    capacity_bytes: int
    limit: str           # "gpu" or "host"
    what: str
    fix: str
    runs: bool           # False: the recipe turns the phase off (eval.samples=0, no validation split)
    parts: dict[str, int]
    views: Views | None = None       # GPU phases
    time: PhaseTime | None = None    # where the time model has figures
    gather_once: bool = False        # samples, rollout under ZeRO-3: the whole model gathered once per generate()
    generating_bytes: int = 0        # samples, rollout: generate()'s own terms in peak_bytes (KV cache, activations)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    def room_to_gather_once(self, free_bytes: int, whole_bytes: int) -> bool:
        """The one rule for gathering the whole model once per generate() under ZeRO-3, in the plan
        (Target._gather_once: free = capacity - what the rank holds beside generate()) and at run time (gathering.py:
        free = what the device has left, measured): the room must take the 16-bit model and generate()'s own terms."""
        return free_bytes >= whole_bytes + self.generating_bytes


@dataclass(frozen=True)
class Phases:
    """Every phase of the job, in the order it runs (planner/phases.py)."""
    train_step: Phase
    validation: Phase
    samples: Phase
    save: Phase
    save_host: Phase
    resume: Phase
    resume_host: Phase
    finalize: Phase
    quantize: Phase
    reference: Phase | None = None  # DPO: the starting model's log-probs, before the first step
    rollout: Phase | None = None    # GRPO: each micro-step's sampled completions, before its forward

    ORDER = ("train_step", "rollout", "reference", "validation", "samples", "save", "save_host", "resume", "resume_host",
             "finalize", "quantize")

    def items(self) -> list[tuple[str, Phase]]:
        """(name, phase) of every phase this job has, in ORDER."""
        return [(n, p) for n in self.ORDER if (p := getattr(self, n)) is not None]


# ---------------------------------------------------------------------------------------------
# Time per optimizer step
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Terms:
    """Seconds of one optimizer step by term (planner/time.py step_time); or each term's share of the step."""
    compute: float
    communication: float
    host: float  # ZeRO-3's host work where a pass's GPU work is shorter
    optimizer: float
    fixed: float
    rollout: float = 0.0  # GRPO: sampling the step's completions (every other recipe: none, and not listed)

    def items(self) -> list[tuple[str, float]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name != "rollout" or self.rollout]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.items())


@dataclass(frozen=True)
class MicroStep:
    """One micro-step on one GPU: its compute, its traffic before overlap, and what is not hidden."""
    compute_s: float
    communication_s: float
    exposed_s: float
    forward_gather_s: float | None = None    # ZeRO-3
    backward_gather_s: float | None = None   # ZeRO-3
    reduce_scatter_s: float | None = None    # ZeRO-2, ZeRO-3
    offload_grad_pcie_s: float | None = None  # optimizer offload
    sequence_parallel_s: float | None = None  # Ulysses' all-to-alls, on the critical path
    latency_s: float | None = None           # NCCL's per-collective latency, within the traffic above
    collectives: int | None = None
    host_s: float | None = None              # ZeRO-3's host work over the passes (hooks, fetch, release)
    host_exposed_s: float | None = None      # of it, what the GPU's work does not cover

    def traffic(self) -> list[tuple[str, float]]:
        """(what, seconds) of each kind of traffic this micro-step has."""
        kinds = ("forward_gather_s", "backward_gather_s", "reduce_scatter_s", "offload_grad_pcie_s",
                 "sequence_parallel_s")
        return [(k.removesuffix("_s").replace("_", " "), v) for k in kinds if (v := getattr(self, k)) is not None]


@dataclass(frozen=True)
class FixedParts:
    fetch_s: float
    bookkeeping_s: float
    save_s: float  # a checkpoint save, spread over the steps between saves


@dataclass(frozen=True)
class NodeCluster:
    """The recipe's step on one node count and one cluster type."""
    cluster: str
    seconds_per_step: float
    terms: Terms
    per_micro_step: MicroStep
    fixed_parts: FixedParts
    communication_over_compute: float
    crossover_tokens: float | None
    speedup: float | None = None               # over one node of the same cluster type
    tokens_per_s_per_gpu: float | None = None
    hpz_seconds_per_step: float | None = None  # with zero_hpz_partition_size = GPUs per node (several nodes)
    hpz_terms: Terms | None = None


@dataclass(frozen=True)
class NodeRow:
    nodes: int
    world_size: int
    grad_accum: int
    exact_batch: bool
    peak_bytes: int
    fits: bool
    hpz_extra_bytes: int
    hpz_fits: bool
    clusters: tuple[NodeCluster, ...]

    def on(self, cluster: str) -> NodeCluster:
        return next(c for c in self.clusters if c.cluster == cluster)


@dataclass(frozen=True)
class NodeTable:
    """The recipe's batch on 1, 2, 4, 8 nodes, on its cluster type and the alternatives beside it."""
    cluster: str
    clusters: tuple[str, ...]
    rows: tuple[NodeRow, ...]
    hpz_worth: float  # the share of a step hpZ must save to be advised


@dataclass(frozen=True)
class StepTime:
    """FLOPs of one optimizer step and, where the target has figures, its seconds by term (planner/time.py)."""
    tokens_per_step: float  # processed: the global batch, or DPO's pairs as padded (row_tokens_from)
    row_tokens_from: str | None  # DPO: where the rows' length comes from; None: rows of seq_len
    flops_per_step: float
    flops_dense: float
    flops_recompute: float
    flops_attention: float
    attention_kind: str
    attention_span: float | None
    attention_span_from: str | None
    mfu: float | None
    seconds_per_step: float | None = None  # None: no peak TFLOPS or cluster type for this target
    grad_accum: int | None = None
    terms: Terms | None = None
    dominant: str | None = None
    per_micro_step: MicroStep | None = None
    step_communication_s: float = 0.0
    communication_over_compute: float | None = None
    crossover_tokens: float | None = None
    optimizer_how: str | None = None
    fixed_parts: FixedParts | None = None
    overlap: float | None = None
    prefetch: str = "all"  # the ZeRO-3 passes whose gathers are prefetched: "all", "forward", "none" (time.Job)
    cluster: str | None = None
    cluster_describe: str | None = None
    inter_node_gbs: float | None = None
    intra_node_gbs: float | None = None
    nodes: NodeTable | None = None


# ---------------------------------------------------------------------------------------------
# The batch choices
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One (seq_len, micro-batch) that reaches the global batch exactly."""
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    peak_bytes: int
    fits: bool
    seconds_per_step: float | None
    flops_per_step: float
    attention_kind: str
    sequence_parallel: int  # ranks sharing each row
    recipe: bool  # the recipe's own


@dataclass(frozen=True)
class Suggestion:
    """Nothing fits: one switch tried alone at the recipe's seq_len, and the peak it gives."""
    override: str | None  # the recipe override; None: more GPUs (gpus)
    peak_bytes: int
    fits: bool
    slower: bool = False  # fits at a cost in speed (optimizer offload)
    gpus: int | None = None


# ---------------------------------------------------------------------------------------------
# Data, disk, preemption, inference, replay
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSteps:
    """The run's optimizer steps from the prepared sequences (None before `make data`)."""
    train_sequences: int | None = None
    eval_sequences: int | None = None
    sequences_per_step: int | None = None
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    label_tokens_per_row: float | None = None  # the fp16 loss scale of a preference objective reads it


@dataclass(frozen=True)
class DiskEvent:
    event: str
    checkpoints_held: int
    bytes: int
    needed_free_bytes: int | None = None  # events_now: what the file system must still offer

    @property
    def is_save(self) -> bool:
        return "save" in self.event


@dataclass(frozen=True)
class Held:
    """What the run holds now that later events replace."""
    checkpoints: int
    checkpoint_steps: tuple[int, ...]
    checkpoint_bytes: int
    model_staging_bytes: int


@dataclass(frozen=True)
class WorldSizeChange:
    """Resuming on another number of GPUs: the checkpoint converted to DeepSpeed's universal format."""
    bytes: int
    peak_bytes: int
    convert_s: float
    load_read_bytes_per_node: int


@dataclass(frozen=True)
class Disk:
    """Bytes under output_dir at each event of a fresh run, and what this run still needs free (planner/disk.py)."""
    checkpoint_bytes: int
    model_bytes: int
    events: tuple[DiskEvent, ...]
    peak_bytes: int
    checkpoints_at_once: int
    held: Held
    events_now: tuple[DiskEvent, ...]
    needed_free_bytes: int
    needed_at: str
    world_size_change: WorldSizeChange | None = None  # ZeRO-3 only


@dataclass(frozen=True)
class Preemption:
    """What a time limit or a kill costs under slurm/finetune.sbatch."""
    save_s: float
    save_bytes_per_s: float  # the assumed write rate save_s comes from
    signal_lead_s: int
    idle_at_time_limit_s: float | None = None
    lost_on_kill_s: float | None = None
    save_steps: int | None = None


@dataclass(frozen=True)
class QuantFit:
    quant: str
    gguf_bytes: int
    t4_fits: bool
    t4_max_context: int


@dataclass(frozen=True)
class Inference:
    """GGUF sizes and whether each fits a T4."""
    kv_bytes_per_token: int
    t4_usable_gib: float
    quant: tuple[QuantFit, ...]
    recipe_quant: str

    def of(self, quant: str) -> QuantFit:
        return next(q for q in self.quant if q.quant == quant)


@dataclass(frozen=True)
class ReplayTime:
    seconds: float
    decode_s: float
    prefill_s: float
    seconds_per_step: float
    mfu: float
    efficiency: float   # the share of memory bandwidth a decode step is assumed to reach
    memory_bound: bool


@dataclass(frozen=True)
class ReplayRun:
    """The answering at one eval.batch_size: its peak on the device, and its time where the GPU has figures."""
    phase: Phase
    rows: int           # prompts per generate() call
    batches: int
    generated_tokens_max: int
    time: ReplayTime | None = None


@dataclass(frozen=True)
class Replay:
    """data.replay's answering in the data step, before the job: the base model on one device (planner/replay.py)."""
    prompts: int
    path: str
    prompt_limit: int | None
    prompt_tokens: int        # the longest templated prompt
    prompt_tokens_from: str   # measured by `make data`, or a bound from the file's bytes
    batch_size: int
    max_new_tokens: int
    precision: str
    device: str
    run: ReplayRun
    largest_batch_that_fits: int | None = None


# ---------------------------------------------------------------------------------------------
# Warnings: the numbers; report.py has the words
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FewSteps:
    total_steps: int
    train_sequences: int
    sequences_per_step: int
    epochs: float
    min_steps: int


@dataclass(frozen=True)
class OffloadTime:
    """Optimizer offload with the time model's figures: CPU Adam and the PCIe traffic."""
    optimizer_s: float
    pcie_s: float
    compute_s: float
    tokens_micro: int
    world: int


@dataclass(frozen=True)
class OffloadUnmodelled:
    """Optimizer offload on a target without time figures."""


@dataclass(frozen=True)
class OffloadHostRam:
    need_bytes: int
    cpu_ram_gb: float


@dataclass(frozen=True)
class HpzCopy:
    hpz: int
    extra_bytes: int
    peak_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class FinalizeHostRam:
    peak_bytes: int
    cpu_ram_gb: float
    merge: bool


WARNINGS = {c.__name__: c for c in (FewSteps, OffloadTime, OffloadUnmodelled, OffloadHostRam, HpzCopy,
                                    FinalizeHostRam)}
PlanWarning = typing.Union[FewSteps, OffloadTime, OffloadUnmodelled, OffloadHostRam, HpzCopy, FinalizeHostRam]


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What `compute_plan` predicts for one recipe on one cluster."""
    recipe: str
    model: ModelSummary
    cluster: Cluster
    choice: Choice
    recipe_batch: RecipeBatch
    memory: Memory
    options: tuple[Option, ...]
    recommended: Option | None
    suggestions: tuple[Suggestion, ...]
    phases: Phases
    time: StepTime
    data: DataSteps
    inference: Inference
    disk: Disk
    preemption: Preemption
    replay: Replay | None = None  # data.replay's answering, before the job (not part of preflight)
    replay_error: str | None = None  # the replay prompts could not be read: the data step says why
    warnings: tuple[PlanWarning, ...] = field(default=())

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, obj: dict) -> Plan:
        return _from_json(cls, obj)

    @classmethod
    def read(cls, path: Path) -> Plan | None:
        """plan.json as the launch wrote it; None when there is none."""
        path = Path(path)
        if not path.is_file():
            return None
        return cls.from_json(json.loads(path.read_text()))


# ---------------------------------------------------------------------------------------------
# JSON, both ways, from the annotations
# ---------------------------------------------------------------------------------------------


def _to_json(x):
    if dataclasses.is_dataclass(x):
        out = {f.name: _to_json(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"kind": type(x).__name__, **out} if type(x).__name__ in WARNINGS else out
    if isinstance(x, (list, tuple)):
        return [_to_json(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    return x


def _from_json(tp, value):
    """Build `value` (parsed JSON) as the annotated type `tp`."""
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value.__class__ is dict and "kind" in value and value["kind"] in WARNINGS:
            return _from_json(WARNINGS[value["kind"]], {k: v for k, v in value.items() if k != "kind"})
        return _from_json(next(a for a in args if a is not type(None)), value)
    if origin is tuple:
        return tuple(_from_json(args[0], v) for v in value)
    if origin is dict:
        return {k: _from_json(args[1], v) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _from_json(hints[f.name], value[f.name]) for f in dataclasses.fields(tp)
                     if f.name in value})
    if tp is float and isinstance(value, int):
        return float(value)
    return value
