"""The plan of a training job, computed once: will it fit, how long will it take (`zerotune plan`, preflight).

Everything is computed for the recipe's target cluster (`plan:`), not for this machine, so a laptop can plan a V100
job. Memory per GPU comes from memory.py (DeepSpeed's estimator for model states + modelled buffers and activations)
for the training step, and from phases.py for every other phase of the job (validation, samples, save, resume,
finalize, quantize); disk per event from disk.py; time per optimizer step from time.py (compute at an assumed MFU,
the communication it cannot hide, the optimizer step, fixed costs), on 1-8 nodes. Before the job, data.replay's
answering in the data step (one GPU, phases.py replay_plan): reported, never refused by preflight (it has run by
the time finetune starts).

`compute_plan` returns a `Plan`; report.py prints it, gate.py refuses a launch it says will not fit. A launch
computes it once (train/launch.py before_launch, slurm/job.py) and hands it to every check that needs it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .. import batch as batchmod
from .. import ds_config, hardware
from .. import manifest as mf
from ..config import Recipe
from ..errors import UserError
from ..layout import layout
from ..quant_types import QUANT_TYPES
from . import time as timemodel
from .disk import disk_events, held, world_size_change
from .flops import flops_per_step
from .memory import GiB, ModelConfigError, memory_breakdown, model_shape
from .phases import phase_plan, replay_plan


class PlanError(UserError, RuntimeError):
    """The recipe is predicted not to fit its target; the message says why and what to change."""


@dataclass(frozen=True)
class Plan:
    """What `compute_plan` predicts for one recipe on one cluster. Each field is a JSON-ready dict (or list) whose
    keys report.py prints; `plan --json` and plan/plan.json are `to_json()`."""
    recipe: str
    model: dict          # the shape: parameters, layers, widths, family
    cluster: dict        # gpu, gpus_per_node, nodes, world_size, capacity_bytes
    choice: dict         # precision, attention, liger, and why
    recipe_config: dict  # seq_len, micro-batch, grad_accum (or batch_error), fits
    memory: dict         # the training step's per-GPU parts and peak
    options: list        # every (seq_len, micro-batch) reaching the global batch: peak, fits, time
    recommended: dict | None
    suggestions: list
    phases: dict         # every phase's peak (phases.py)
    time: dict           # FLOPs and time per optimizer step, the node table
    data: dict           # steps from the prepared sequences
    inference: dict      # GGUF sizes and the T4 fit
    warnings: list
    disk: dict           # bytes per event, needed_free_bytes
    preemption: dict     # save time, signal lead, what a time limit or a kill costs
    finalize: dict       # host RAM of the finalize process
    replay: dict | None  # data.replay's answering, before the job

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


SEQ_CHOICES = (2048, 4096, 8192, 16384, 32768)
MICRO_CHOICES = (1, 2, 4, 8)
RECOMMEND_GAIN = 0.05  # a recommendation other than the recipe's own must save more than this per step
MIN_STEPS = 20  # below this, warmup/cosine schedules and loss curves mean little
# GGUF types the plan sizes for the T4 (bits per weight from the one quantization table)
PLANNED_QUANTS = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
T4 = hardware.GPUS["t4"]


def _cluster(r: Recipe, gpu, gpus_per_node, nodes):
    name = gpu or r.plan.gpu
    if name not in hardware.GPUS:
        raise PlanError(f"plan.gpu '{name}' unknown; choose one of {sorted(hardware.GPUS)}.")
    g = hardware.GPUS[name]
    return name, g, gpus_per_node or r.plan.gpus_per_node, nodes or r.plan.nodes


def _capacity_bytes(r: Recipe, g: hardware.GPU, gpus_per_node: int) -> int:
    if g.capability is None:  # CPU target: every process shares the node's RAM
        return int(r.plan.cpu_ram_gb * 1e9 / gpus_per_node)
    return int(g.usable_gib * GiB)  # the total PyTorch reports (hardware.GPU.usable_gib)


def _grad_accum_bytes(ds: dict | None) -> int | None:
    """DeepSpeed's gradient accumulation dtype (data_types.grad_accum_dtype; None: the model's)."""
    return hardware.PRECISION_BYTES.get(((ds or {}).get("data_types") or {}).get("grad_accum_dtype"))


def _grad_accum(r: Recipe, seq: int, micro: int, world: int) -> int:
    """micro: rows per micro-batch, the planner's unit (_rows: a DPO pair's chosen and rejected rows count two)."""
    return batchmod.grad_accum(r.train.global_batch_tokens, seq, micro, world)


def _rows(r: Recipe, micro: int) -> int:
    return micro * batchmod.rows_per_sample(r)


def _memory(r, shape, choice, zero, seq, micro, gpus_per_node, nodes, g, accum=None):
    return memory_breakdown(shape, seq=seq, micro=micro, precision=choice.precision, attention=choice.attention,
                            liger=choice.liger, checkpointing=r.train.gradient_checkpointing,
                            packing=r.data.packing, zero=zero, gpus_per_node=gpus_per_node, nodes=nodes,
                            gpu_is_cuda=g.capability is not None, peft=_peft(r, shape), capability=g.capability,
                            lm_head_trainable=r.peft.method == "none" or "lm_head" in r.peft.modules_to_save,
                            grad_accum_bytes=accum, grad_accum=_grad_accum(r, seq, micro, gpus_per_node * nodes),
                            preference_chunk=r.preference.chunk_tokens if r.pairs else None)


def _peft(r: Recipe, shape):
    if r.peft.method == "none":
        return None
    from .memory import peft_trainable_params

    return r.peft.method, peft_trainable_params(shape, r.peft.r, r.peft.target_modules, r.peft.modules_to_save)


def _disk(r: Recipe, shape, choice, peft, total_steps: int | None) -> dict:
    """Bytes on the shared file system: each checkpoint holds the fp32 master weights and Adam m, v of the
    trainable parameters (12 B each, split over ranks) plus the Trainer's own save of the model (the gathered
    16-bit weights, or the adapter); finalize stages the published model beside them. Per event, counting the
    committed checkpoints this run already holds: planner/disk.py."""
    w = hardware.dtype_bytes(choice.precision)
    trainable = peft[1] if peft else shape.n_params
    ckpt = 12 * trainable + w * trainable
    model = w * shape.n_params
    paths = layout(r)
    events = disk_events(checkpoint_bytes=ckpt, model_bytes=model, adapter_bytes=w * trainable if peft else None,
                         save_total_limit=r.train.save_total_limit, save_steps=r.train.save_steps,
                         total_steps=total_steps,  # None until the data is prepared
                         now=held(paths.checkpoints, paths.model_staging))
    return {"checkpoint_bytes": ckpt, "model_bytes": model, **events}


SAVE_BYTES_PER_S = 1e9  # assumed checkpoint write rate to shared storage, all ranks together: measure your own


def _preemption(r: Recipe, time: dict, disk: dict) -> dict:
    """What a time limit or a kill costs under slurm/finetune.sbatch. At a time limit the workers stop at a step
    boundary with a commit when the next step + save + margin would not fit (stopping.out_of_time): no trained
    step is lost, up to that much of the allocation goes unused. A kill without warning loses the steps since
    the last save. The USR1 lead must cover at least one save (the step in flight is finished first)."""
    from ..stopping import seconds_needed

    step = time["seconds_per_step"]
    save = disk["checkpoint_bytes"] / SAVE_BYTES_PER_S
    every = r.train.save_steps if r.train.save_steps > 0 else None
    return {"save_s": save, "idle_at_time_limit_s": seconds_needed(step, save) if step else None,
            "lost_on_kill_s": every * step if step and every else None, "save_steps": every,
            "signal_lead_s": 60 * math.ceil(seconds_needed(0, save) / 60)}


def _doc_lengths(r: Recipe) -> dict | None:
    """The prepared data's document lengths (p50, p99, ...), its attention span and the seq_len it was packed at."""
    man = mf.read(layout(r).data_manifest)
    if not man:
        return None
    return {**(man.get("doc_length") or {}), "attention_span": man.get("attention_span"),
            "seq_len": (man.get("packing") or {}).get("seq_len")}


def _zero_settings(zero: dict | None) -> dict:
    """What the time model reads from the resolved zero_optimization (ds_config.build)."""
    zero = zero or {}
    return {"zero_stage": int(zero.get("stage", 0) or 0),
            "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme"),
            "hpz": int(zero.get("zero_hpz_partition_size", 1) or 1)}


def _step_time(r, shape, g, gpu_name, seq, world, micro: int, attention: str, docs: dict | None = None, *,
               gpus_per_node: int | None = None, precision: str = "fp16", zero: dict | None = None,
               save_s: float = 0.0, cluster: str | None = None, hpz: int | None = None) -> dict:
    """FLOPs per optimizer step and the time it takes: compute at the assumed MFU (the kernels' efficiency
    alone) + the communication it cannot hide + the optimizer step + fixed costs (planner/time.py)."""
    out = flops_per_step(r, shape, seq, micro, attention, docs)
    mfu = r.plan.mfu or hardware.GPUS[gpu_name].default_mfu
    out.update(mfu=mfu, seconds_per_step=None)
    if not (mfu and g.peak_tflops):
        return out
    gpn = gpus_per_node or world
    if not (cluster or g.cluster):
        return out
    c = timemodel.CLUSTERS[cluster or g.cluster]
    job = _job(r, shape, out["flops_per_step"], seq, micro, gpn, world // gpn, precision, zero, save_s, hpz)
    t = timemodel.step_time(job, c, hardware.peak_tflops(g, precision), mfu)  # fp32 (Gemma 3 on V100): its own peak
    out.update(seconds_per_step=t["seconds_per_step"], grad_accum=job.grad_accum, **{k: t[k] for k in (
        "terms", "dominant", "shares", "per_micro_step", "step_communication_s", "communication_over_compute",
        "crossover_tokens",
        "optimizer_how", "fixed_parts", "overlap", "cluster", "inter_node_gbs", "intra_node_gbs")})
    out["cluster_describe"] = c.describe
    return out


def _job(r, shape, flops_per_step, seq, micro, gpn, nodes, precision, zero, save_s, hpz=None) -> timemodel.Job:
    world = gpn * nodes
    ga = _grad_accum(r, seq, micro, world)
    zs = _zero_settings(zero)
    peft = _peft(r, shape)
    numels, bucket = shape.zero3_modules(zero)
    return timemodel.Job(n_params=shape.n_params, trainable=peft[1] if peft else shape.n_params,
                         flops_micro=flops_per_step / (world * ga),
                         forward_share=0.25 if r.train.gradient_checkpointing else 1 / 3,
                         tokens_micro=seq * micro, grad_accum=ga, gpus_per_node=gpn, nodes=nodes,
                         dtype_bytes=hardware.dtype_bytes(precision), zero_stage=zs["zero_stage"],
                         offload_optimizer=zs["offload_optimizer"], hpz=zs["hpz"] if hpz is None else hpz,
                         save_s=save_s, save_steps=r.train.save_steps,
                         module_numels=numels, reduce_bucket=bucket)


NODE_COUNTS = (1, 2, 4, 8)


def _node_table(r, shape, g, gpu_name, choice, zero, accum, gpn, docs, save_s, capacity, own: str) -> dict:
    """The recipe's own batch on 1, 2, 4, 8 nodes of the same kind (GA from the world size), with and without
    ZeRO++ hierarchical partitioning (zero_hpz_partition_size = GPUs per node) and its memory, on the GPU's
    cluster type and the alternatives beside it (planner/time.py CLUSTERS)."""
    seq, micro = r.data.seq_len, _rows(r, r.train.micro_batch_size)
    clusters = (own, *timemodel.ALTERNATIVES.get(own, ()))
    rows = []
    for n in NODE_COUNTS:
        world = gpn * n
        exact = r.train.global_batch_tokens % (seq * micro * world) == 0
        peak = _memory(r, shape, choice, zero, seq, micro, gpn, n, g, accum)["peak"]
        hpz_extra = timemodel.hpz_bytes(shape.n_params, hardware.dtype_bytes(choice.precision), gpn)
        row = {"nodes": n, "world_size": world, "grad_accum": _grad_accum(r, seq, micro, world), "exact_batch": exact,
               "peak_bytes": peak, "fits": peak <= capacity, "hpz_extra_bytes": hpz_extra if n > 1 else 0,
               "hpz_fits": peak + hpz_extra <= capacity, "clusters": {}}
        for c in clusters:
            kw = dict(gpus_per_node=gpn, precision=choice.precision, zero=zero, save_s=save_s, cluster=c)
            base = _step_time(r, shape, g, gpu_name, seq, world, micro, choice.attention, docs, hpz=1, **kw)
            entry = {k: base[k] for k in ("seconds_per_step", "terms", "communication_over_compute",
                                          "crossover_tokens", "per_micro_step", "fixed_parts")}
            if n > 1 and zero and int(zero.get("stage", 0) or 0) == 3:
                hp = _step_time(r, shape, g, gpu_name, seq, world, micro, choice.attention, docs, hpz=gpn, **kw)
                entry["hpz_seconds_per_step"] = hp["seconds_per_step"]
                entry["hpz_terms"] = hp["terms"]
            row["clusters"][c] = entry
        rows.append(row)
    one = {c: rows[0]["clusters"][c]["seconds_per_step"] for c in clusters}
    for row in rows:
        for c, e in row["clusters"].items():
            e["speedup"] = one[c] / e["seconds_per_step"] if e["seconds_per_step"] else None
            e["tokens_per_s_per_gpu"] = r.train.global_batch_tokens / e["seconds_per_step"] / row["world_size"]
    return {"cluster": own, "clusters": list(clusters), "rows": rows,
            "advice": _node_advice(rows, own, gpn, capacity, seq * micro)}


def _node_advice(rows, own, gpn, capacity, tokens: int) -> list[str]:
    """What the model says about node counts: the scaling and what it loses, where communication overtakes
    compute, and whether ZeRO++ hpZ pays at 4 nodes."""
    multi = [row for row in rows if row["nodes"] > 1]
    if not multi:
        return []
    one, two = rows[0]["clusters"][own], multi[0]["clusters"][own]
    scale = ", ".join(f"{row['nodes']} nodes {row['clusters'][own]['speedup']:.2f}x" for row in multi)
    lost = ", ".join(f"{row['clusters'][own]['terms']['communication'] / row['clusters'][own]['seconds_per_step']:.1%}"
                     for row in multi)
    fixed = rows[0]["clusters"][own]["fixed_parts"]
    out = [f"scaling on {own}: {scale} one node; communication not hidden: {lost} of the step; the checkpoint "
           f"save ({fixed['save_s']:,.0f} s/step) does not shrink with more nodes",
           f"communication overtakes compute below ~{two['crossover_tokens']:,.0f} tokens per GPU per micro-step "
           f"across nodes (~{one['crossover_tokens']:,.0f} inside one node); the recipe runs {tokens:,} "
           "(seq_len x micro-batch)"]
    four = next((row for row in rows if row["nodes"] == 4), multi[-1])
    e = four["clusters"][own]
    if "hpz_seconds_per_step" in e:
        saved = e["seconds_per_step"] - e["hpz_seconds_per_step"]
        share = saved / e["seconds_per_step"]
        mem = four["peak_bytes"] + four["hpz_extra_bytes"]
        fits = mem <= capacity
        worth = fits and share >= HPZ_WORTH
        out.append(f"ZeRO++ hpZ at {four['nodes']} nodes (train.zero.zero_hpz_partition_size={gpn}): all gathers but "
                   f"the step's first stay in the node; saves {saved:,.0f} s/step ({share:.1%}) for "
                   f"+{four['hpz_extra_bytes'] / GiB:.2f} GiB per GPU (peak {mem / GiB:.2f} of "
                   f"{capacity / GiB:.2f} GiB: {'fits' if fits else 'DOES NOT FIT'}): "
                   + ("use it" if worth else f"not worth it below {HPZ_WORTH:.0%}")
                   + " (convergence reports: DeepSpeed #4851, #7606; compare first losses with and without)")
    return out


HPZ_WORTH = 0.05  # advise hpZ when it saves at least this share of the step: less is within the model's error


def _data_steps(r: Recipe, bp: batchmod.BatchPlan | None) -> dict:
    """The run's optimizer steps from the prepared sequences, counted as the worker counts them (BatchPlan)."""
    man = mf.read(layout(r).data_manifest)
    if not man or "sequences" not in man or bp is None:
        return {"train_sequences": None, "steps_per_epoch": None, "total_steps": None}
    n = man["sequences"]["train"]
    return {"train_sequences": n, "sequences_per_step": bp.sequences_per_step, "steps_per_epoch": bp.steps_per_epoch(n),
            "total_steps": bp.total_steps(n, r.train.max_steps, r.train.epochs),
            "eval_sequences": man["sequences"].get("eval")}


def _inference(r: Recipe, shape) -> dict:
    kv_per_token = hardware.kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim)
    rows = {}
    for q in PLANNED_QUANTS:
        size = shape.n_params * QUANT_TYPES[q].bpw / 8
        ctx = hardware.llama_cpp_fit(T4, size, kv_per_token, 0, shape.max_positions)["max_context_that_fits"]
        rows[q] = {"gguf_bytes": int(size), "t4_fits": ctx >= 512, "t4_max_context": ctx}
    return {"kv_bytes_per_token": kv_per_token, "t4_usable_gib": T4.usable_gib, "quant": rows,
            "recipe_quant": r.quantize.type}


# A bound on the chat template's tokens around the prompts' text, without the tokenizer (planning downloads
# nothing). Byte-level BPE (Llama 3, SmolLM2, Qwen, GPT-2 style: every byte is a base token, every token at least one
# byte) never gives more tokens than UTF-8 bytes, so a prompt's content costs at most its byte length; the template
# adds a fixed part and a part per message. Measured with the real tokenizers (tests/test_plan.py): fixed, Llama
# 3.1-Instruct's default system header with its date (<|begin_of_text|>...Cutting Knowledge Date: December
# 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>) 26 tokens + the assistant header 4 = 30; SmolLM2's default system
# block 21 + 4 = 25; per message 5 in both (start, role, end of header or newline, end of turn). Templates with
# longer default system prompts or tool descriptions are not covered.
REPLAY_TEMPLATE_TOKENS = 40
REPLAY_TOKENS_PER_MESSAGE = 8


def replay_prompt_bound(rows: list[dict]) -> int:
    """A bound on the tokens of the longest templated prompt of `rows`: the UTF-8 bytes of its messages' contents +
    the template's fixed and per-message overhead (REPLAY_TEMPLATE_TOKENS, REPLAY_TOKENS_PER_MESSAGE)."""
    return max(sum(len(msg["content"].encode("utf-8")) for msg in row["messages"]) + REPLAY_TEMPLATE_TOKENS
               + REPLAY_TOKENS_PER_MESSAGE * len(row["messages"]) for row in rows)


def _replay(r: Recipe, shape, g: hardware.GPU) -> dict | None:
    """data.replay's answering in the data step (data/replay.py): the base model on one device of the recipe's GPU
    kind in the precision data/replay.py picks there (hardware.choose's auto, fp16 on V100), eval.batch_size prompts
    per generate() call; on a CPU target, host RAM in fp32. None without data.replay."""
    if r.data.replay is None:
        return None
    from ..data.replay import load_prompts

    rp = r.data.replay
    try:
        rows = load_prompts(r)  # data.replay.limit applied
    except UserError as e:  # a missing or bad prompt file: the data step says so; the plan reports it
        return {"error": str(e)}
    precision = hardware.choose(g, fa2_installed=False, family=shape.fam).precision  # as data/replay.py _device_and_dtype
    on_gpu = g.capability is not None
    capacity = int(g.usable_gib * GiB) if on_gpu else int(r.plan.cpu_ram_gb * 1e9)  # one process, the node's RAM
    prompt = replay_prompt_bound(rows)

    def plan(batch, **timing):
        return replay_plan(shape, prompts=len(rows), batch=batch, prompt_tokens=prompt,
                           max_new_tokens=rp.max_new_tokens, e=hardware.dtype_bytes(precision), on_gpu=on_gpu,
                           capacity=capacity, **timing)

    # the GPU's memory bandwidth: the time model's sourced figure for the cluster type around it (planner/time.py)
    hbm = timemodel.CLUSTERS[g.cluster].hbm if g.cluster else None
    out = plan(r.eval.batch_size, bandwidth_gbs=hbm, peak_tflops=g.peak_tflops,
               mfu=r.plan.mfu or g.default_mfu)
    # what to suggest when it does not fit: the largest smaller eval.batch_size that does (None: fits, or none does)
    largest = None if out["fits"] else next((b for b in range(min(r.eval.batch_size, len(rows)) - 1, 0, -1)
                                             if plan(b)["fits"]), None)
    return {"prompts": len(rows), "path": rp.path, "prompt_limit": rp.limit, "prompt_tokens_bound": prompt,
            "batch_size": r.eval.batch_size, "max_new_tokens": rp.max_new_tokens, "precision": precision,
            "device": g.name, "largest_batch_that_fits": largest, **out}


def compute_plan(r: Recipe, gpu: str | None = None, gpus_per_node: int | None = None, nodes: int | None = None,
                 cluster: str | None = None) -> Plan:
    """cluster: a cluster type of planner/time.py CLUSTERS (links between the GPUs); default: the GPU's."""
    gpu_name, g, gpn, nn = _cluster(r, gpu, gpus_per_node, nodes)
    world = gpn * nn
    if cluster is not None and cluster not in timemodel.CLUSTERS:
        raise PlanError(f"cluster '{cluster}' unknown; choose one of {sorted(timemodel.CLUSTERS)}.")
    try:
        shape = model_shape(r)
    except ModelConfigError as e:
        raise PlanError(str(e)) from None
    # Planning for the cluster, not this machine: assume flash-attn is installed where it can be.
    fa2 = g.capability is not None and g.capability >= (8, 0)
    choice = hardware.choose(g, r.train.precision, r.train.attention, r.train.liger, fa2_installed=fa2,
                             family=shape.fam)  # the family's own precision limits (families.py)
    ds = ds_config.build(r)
    zero = ds.get("zero_optimization") if ds else None
    accum = _grad_accum_bytes(ds)
    capacity = _capacity_bytes(r, g, gpn)
    docs = _doc_lengths(r)

    def fits(seq, micro):
        mem = _memory(r, shape, choice, zero, seq, micro, gpn, nn, g, accum)
        return mem, mem["peak"] <= capacity

    own_mem, own_fits = fits(r.data.seq_len, _rows(r, r.train.micro_batch_size))
    try:
        own_batch = batchmod.derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, world,
                                    batchmod.rows_per_sample(r))
        batch_error = None
    except batchmod.BatchError as e:
        own_batch, batch_error = None, str(e)
    phases = _phases(r, shape, choice, zero, g, gpn, world, capacity, own_mem)
    data = _data_steps(r, own_batch)
    disk = _disk(r, shape, choice, _peft(r, shape), data["total_steps"])
    if zero and int(zero.get("stage", 0) or 0) == 3:  # ZeRO-3 partitions the optimizer by rank: another world size converts
        peft = _peft(r, shape)
        disk["world_size_change"] = world_size_change(peft[1] if peft else shape.n_params, world, gpn)
    save_s = disk["checkpoint_bytes"] / SAVE_BYTES_PER_S
    time_kw = dict(gpus_per_node=gpn, precision=choice.precision, zero=zero, save_s=save_s, cluster=cluster)

    options = []
    seqs = sorted({s for s in SEQ_CHOICES if s <= shape.max_positions} | {r.data.seq_len})
    for seq in seqs:
        for micro in MICRO_CHOICES:
            try:
                bp = batchmod.derive(r.train.global_batch_tokens, seq, micro, world, batchmod.rows_per_sample(r))
            except batchmod.BatchError:
                continue  # must reach global_batch_tokens exactly
            mem, ok = fits(seq, _rows(r, micro))
            t = _step_time(r, shape, g, gpu_name, seq, world, _rows(r, micro), choice.attention, docs, **time_kw)
            options.append({"seq_len": seq, "micro_batch_size": micro, "grad_accum": bp.grad_accum,
                            "peak_bytes": mem["peak"], "fits": ok, "seconds_per_step": t["seconds_per_step"],
                            "flops_per_step": t["flops_per_step"], "attention_kind": t["attention_kind"],
                            "recipe": seq == r.data.seq_len and micro == r.train.micro_batch_size})
    fitting = [o for o in options if o["fits"]]
    # Fastest per useful token (same global batch, so fastest per step) among what fits and truncates at
    # most 1% of documents (seq_len >= the prepared data's p99; before `make data`, the recipe's seq_len).
    # Ties (varlen attention costs the same at any seq_len): the recipe's own, then larger micro-batch
    # (better GPU use), then longer rows. Nothing long enough fits: the longest that does.
    floor = min(docs["p99"], r.data.seq_len) if docs and docs.get("p99") else r.data.seq_len
    cands = [o for o in fitting if o["seq_len"] >= floor]
    # Time per step counts communication too (planner/time.py): across nodes, short rows can take longer than
    # their FLOPs say. No peak known (CPU target): FLOPs. The recipe's own choice stands unless another saves
    # more than RECOMMEND_GAIN: a smaller gain is inside the model's own uncertainty.
    def cost(o):
        return o["seconds_per_step"] if o["seconds_per_step"] is not None else o["flops_per_step"]

    rec = (min(cands, key=lambda o: (cost(o), not o["recipe"], -o["micro_batch_size"], -o["seq_len"]))
           if cands else max(fitting, key=lambda o: (o["seq_len"], o["micro_batch_size"])) if fitting else None)
    own_opt = next((o for o in cands if o["recipe"]), None)
    if rec is not None and own_opt is not None and cost(own_opt) <= cost(rec) * (1 + RECOMMEND_GAIN):
        rec = own_opt

    suggestions = [] if rec else _suggestions(r, shape, choice, zero, gpn, nn, g, capacity, accum)
    time = _step_time(r, shape, g, gpu_name, r.data.seq_len, world, _rows(r, r.train.micro_batch_size),
                      choice.attention, docs, **time_kw)
    _samples_gather_once(phases["samples"], shape, choice, capacity, world)
    for name, t in _phase_times(r, shape, g, gpu_name, choice, gpn, nn, cluster, disk, docs, data, time, zero,
                                gather_once=phases["samples"]["gather_once"]).items():
        phases[name]["time"] = t
    if time["seconds_per_step"] and g.cluster and _zero_settings(zero)["zero_stage"] == 3:  # multi-node = ZeRO-3 here
        time["nodes"] = _node_table(r, shape, g, gpu_name, choice, zero, accum, gpn, docs, save_s, capacity,
                                    cluster or g.cluster)
    warnings = []
    if data["total_steps"] is not None and data["total_steps"] < MIN_STEPS:
        warnings.append(f"only {data['total_steps']} optimizer steps in this run ({data['train_sequences']:,} sequences "
                        f"/ {data['sequences_per_step']:,} per step x {r.train.epochs} epochs): fewer than {MIN_STEPS} "
                        "steps make warmup and cosine decay meaningless; lower train.global_batch_tokens or add data.")
    if zero and (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
        if time.get("terms"):
            pm, tt = time["per_micro_step"], time["terms"]
            warnings.append(
                f"optimizer offload (modelled, planner/time.py): CPU Adam + fp16 copy-back {tt['optimizer']:,.0f} s "
                f"per step; the fp32 gradient partition crosses PCIe twice every micro-step, "
                f"{pm.get('offload_grad_pcie_s', 0):.2f} s against {pm['compute_s']:.1f} s of compute at "
                f"{r.data.seq_len * r.train.micro_batch_size:,} tokens per micro-step (hidden behind backward at this "
                f"size). The step is slow because it has {world} GPUs; below ~"
                f"{r.data.seq_len * r.train.micro_batch_size * pm.get('offload_grad_pcie_s', 0) / pm['compute_s']:,.0f}"
                " tokens per micro-step the PCIe traffic alone outlasts the compute.")
        else:
            warnings.append("optimizer offload: CPU Adam and the PCIe traffic are not modelled on this target.")
        cpu_need = own_mem["cpu_bytes_per_node"]
        if cpu_need > r.plan.cpu_ram_gb * 1e9:
            warnings.append(f"CPU RAM: DeepSpeed estimates {cpu_need / 1e9:.0f} GB per node for offloaded states, "
                            f"plan.cpu_ram_gb is {r.plan.cpu_ram_gb:g}.")
    hpz = _zero_settings(zero)["hpz"]
    if hpz > 1:
        extra = timemodel.hpz_bytes(shape.n_params, hardware.dtype_bytes(choice.precision), hpz)
        warnings.append(f"ZeRO++ hpZ (zero_hpz_partition_size={hpz}): its secondary parameter copy, "
                        f"+{extra / GiB:.2f} GiB per GPU, is not in the memory breakdown above (peak with it "
                        f"{(own_mem['peak'] + extra) / GiB:.2f} of {capacity / GiB:.2f} GiB). Compare the first "
                        "losses with and without it before a long run (DeepSpeed #4851, #7606).")
    fin = phases["finalize"]
    if not fin["fits"]:
        warnings.append(f"CPU RAM: finalize (verify{' + merge' if r.peft.method != 'none' else ''} after training) "
                        f"needs {fin['peak_bytes'] / 1e9:.1f} GB on the first node, plan.cpu_ram_gb is "
                        f"{r.plan.cpu_ram_gb:g}; request more memory (sbatch --mem) or run finalize on a larger host.")
    return Plan(
        recipe=r.name, model={"config": shape.config_path, **{k: v for k, v in dataclasses.asdict(shape).items()
                                                             if k not in ("config_path", "module_params")},
                              "gathered_modules": len(shape.zero3_modules(zero)[0])
                              if _zero_settings(zero)["zero_stage"] == 3 else 0},
        cluster={"gpu": gpu_name, "gpu_name": g.name, "gpus_per_node": gpn, "nodes": nn, "world_size": world,
                 "capacity_bytes": capacity},
        choice={"precision": choice.precision, "attention": choice.attention, "liger": choice.liger,
                "reasons": list(choice.reasons)},
        recipe_config={"seq_len": r.data.seq_len, "micro_batch_size": r.train.micro_batch_size,
                       "grad_accum": own_batch.grad_accum if own_batch else None, "batch_error": batch_error,
                       "global_batch_tokens": r.train.global_batch_tokens, "fits": own_fits and not batch_error,
                       "rows_per_sample": batchmod.rows_per_sample(r)},
        memory={"parts": own_mem["parts"], "peak_bytes": own_mem["peak"], "capacity_bytes": capacity,
                "views": own_mem["views"],  # allocated / reserved / nvidia-smi peaks (calibration.py)
                "model_states_how": own_mem["model_states_how"], "logits_how": own_mem["logits_how"],
                "cpu_bytes_per_node": own_mem["cpu_bytes_per_node"]},
        options=options, recommended=rec, suggestions=suggestions,
        phases=phases,  # every phase of the job: phases.py
        time=time, data=data, inference=_inference(r, shape), warnings=warnings,
        disk=disk, preemption=_preemption(r, time, disk),
        finalize={"parts": fin["parts"], "peak_bytes": fin["peak_bytes"], "cpu_ram_bytes": fin["capacity_bytes"]},
        replay=_replay(r, shape, g),  # the data step's answering, before the job (not part of preflight)
    )


def _samples_gather_once(samples: dict, shape, choice, capacity: int, world: int) -> None:
    """In-training samples under ZeRO-3 across ranks: gather the whole model once per round (train/validation.py, as TRL's
    unwrap_model_for_generation does) when it fits beside the phase's own peak, instead of once per generated token.
    Where it fits, the phase holds the 16-bit model too; where it does not (one 8xV100 node at 8B), per-token
    gathers stay, over the node's NVLink. Sets samples["gather_once"] and adds its bytes to the phase."""
    whole = hardware.dtype_bytes(choice.precision) * shape.n_params
    once = world > 1 and samples["peak_bytes"] + whole <= capacity
    samples["gather_once"] = once
    if once:
        samples["parts"]["whole model gathered once (16-bit)"] = whole
        samples["peak_bytes"] += whole
        samples["fits"] = samples["peak_bytes"] <= samples["capacity_bytes"]
        samples["what"] += "; the whole model gathered once per round"


def _phase_times(r: Recipe, shape, g, gpu_name, choice, gpn: int, nodes: int, cluster, disk: dict, docs, data: dict,
                 time: dict, zero: dict | None, gather_once: bool = False) -> dict:
    """Each non-training phase's seconds on the target cluster (time.phase_times); {} where the time model has
    no figures (a CPU target)."""
    from ..answering import eval_sets

    mfu = r.plan.mfu or hardware.GPUS[gpu_name].default_mfu
    name = cluster or g.cluster
    if not (mfu and g.peak_tflops and name):
        return {}
    sets = eval_sets(r)
    seq = r.data.seq_len
    span = (time.get("attention_span") or (seq / 2 if time["attention_kind"] == "causal" else seq))
    return timemodel.phase_times(
        n_params=shape.n_params, layers=shape.layers, q_dim=shape.q_dim,
        dtype_bytes=hardware.dtype_bytes(choice.precision), world=gpn * nodes, nodes=nodes,
        c=timemodel.CLUSTERS[name], peak_tflops=hardware.peak_tflops(g, choice.precision), mfu=mfu, seq=seq,
        attention_span=span, eval_rows=_rows(r, data.get("eval_sequences") or 0) if r.data.eval_fraction > 0 else 0,
        samples=r.eval.samples if sets else 0, prompt_tokens=seq,  # the memory phase's bound: prompts <= a row
        new_tokens=sets[0].max_new_tokens if sets else 0, checkpoint_bytes=disk["checkpoint_bytes"],
        model_bytes=disk["model_bytes"], save_s=disk["checkpoint_bytes"] / SAVE_BYTES_PER_S, gather_once=gather_once,
        # DPO: a micro-batch's rows per no-grad forward; the reference pass: every pair's 2 rows (None: no data yet)
        rows_per_forward=_rows(r, r.train.micro_batch_size) if r.pairs else 1,
        reference_rows=_rows(r, data["train_sequences"] + (data.get("eval_sequences") or 0))
        if r.pairs and data["train_sequences"] is not None else None,
        module_numels=shape.zero3_modules(zero)[0])


def _phases(r: Recipe, shape, choice, zero, g, gpn: int, world: int, capacity: int, train: dict) -> dict:
    """The recipe's own batch through every phase of its job (planner/phases.py)."""
    from ..answering import eval_sets

    peft = _peft(r, shape)
    sets = eval_sets(r)  # in-training samples answer the first set's prompts (validation._sample_prompts)
    seq, micro = r.data.seq_len, _rows(r, r.train.micro_batch_size)
    return phase_plan(m=shape, train=train, precision=choice.precision, attention=choice.attention,
                      liger=choice.liger, packing=r.data.packing, zero=zero, world=world, gpus_per_node=gpn,
                      on_gpu=g.capability is not None, seq=seq, micro=micro,
                      grad_accum=_grad_accum(r, seq, micro, world),
                      trainable=peft[1] if peft else shape.n_params, peft=peft, gpu_capacity=capacity,
                      host_capacity=int(r.plan.cpu_ram_gb * 1e9), validation_runs=r.data.eval_fraction > 0,
                      samples=r.eval.samples if sets else 0,
                      max_new_tokens=sets[0].max_new_tokens if sets else 0, quant_type=r.quantize.type,
                      preference_chunk=r.preference.chunk_tokens if r.pairs else None)


def _suggestions(r, shape, choice, zero, gpn, nn, g, capacity, accum=None) -> list[str]:
    """Nothing fits: try the usual switches one at a time at the recipe's seq_len, report which work."""
    seq, micro = r.data.seq_len, _rows(r, 1)
    out = []

    def peak(ch=choice, z=zero, s=seq, n=gpn):
        return _memory(r, shape, ch, z, s, micro, n, nn, g, accum)["peak"]

    if not choice.liger and g.capability is not None:
        p = peak(ch=dataclasses.replace(choice, liger=True))
        out.append(f"train.liger=on: {p / GiB:.1f} GiB ({'fits' if p <= capacity else 'still too big'})")
    if zero is not None and int(zero.get("stage", 0)) == 3 and not zero.get("offload_optimizer"):
        z = {**zero, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        p = peak(z=z)
        out.append(f"train.zero.offload_optimizer={{device: cpu}}: {p / GiB:.1f} GiB "
                   f"({'fits' if p <= capacity else 'still too big'}; several times slower)")
    for s in [x for x in SEQ_CHOICES if x < seq][::-1]:
        p = peak(s=s)
        if p <= capacity:
            out.append(f"data.seq_len={s}: {p / GiB:.1f} GiB (fits)")
            break
    p = peak(n=gpn * 2)
    out.append(f"twice the GPUs ({gpn * 2 * nn}): {p / GiB:.1f} GiB ({'fits' if p <= capacity else 'still too big'})")
    return out
