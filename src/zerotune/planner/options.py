"""The batch choices: every (seq_len, micro-batch) that reaches the recipe's global batch exactly, which of them
the plan recommends, and, when none fits, which single switch would make the recipe's own fit."""

from __future__ import annotations

import dataclasses

from .. import batch as batchmod
from .records import Option, Suggestion
from .target import Target

SEQ_CHOICES = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
MICRO_CHOICES = (1, 2, 4, 8)
RECOMMEND_GAIN = 0.05  # a recommendation other than the recipe's own must save more than this per step


def sequence_parallel_choices(t: Target) -> tuple[int, ...]:
    """The sequence-parallel degrees this model and node allow: divisors of the node's GPUs (a row's ranks stay in
    one node) that split the heads as DeepSpeed's Ulysses needs (config.check_sequence_parallel_heads). None but 1
    for DPO and GRPO (config.py refuses them: a pair's rows and a rollout are whole on each rank)."""
    m = t.shape
    if t.r.pairs or t.r.grpo:
        return (1,)
    return tuple(n for n in range(1, t.gpus_per_node + 1) if t.gpus_per_node % n == 0 and m.heads % n == 0
                 and (m.kv_heads % n == 0 or n % m.kv_heads == 0))


def options(t: Target) -> tuple[Option, ...]:
    """Every (seq_len, micro-batch) that reaches the global batch exactly, each at the smallest sequence-parallel
    degree that fits it (the largest tried when none does), and the recipe's own at its own degree."""
    r = t.r
    sps = sequence_parallel_choices(t) if t.zero is not None else (1,)  # Ulysses rides DeepSpeed
    out = []

    def option(seq: int, micro: int, sp: int, grad_accum: int) -> Option:
        peak = t.memory(seq, t.rows(micro), sp=sp)["peak"]
        st = t.step_time(seq, t.rows(micro), sp=sp)
        return Option(seq_len=seq, micro_batch_size=micro, grad_accum=grad_accum, peak_bytes=peak,
                      fits=peak <= t.capacity, seconds_per_step=st.seconds_per_step, flops_per_step=st.flops_per_step,
                      attention_kind=st.attention_kind, sequence_parallel=sp,
                      recipe=(seq, micro, sp) == (r.data.seq_len, r.train.micro_batch_size, t.sp))

    # GRPO: seq_len bounds a prompt + its completion and sets how many prompts make a step: another is other work,
    # not another way to run this one; only the micro-batch varies
    seqs = {r.data.seq_len} if r.grpo else {s for s in SEQ_CHOICES if s <= t.shape.max_positions} | {r.data.seq_len}
    for seq in sorted(seqs):
        for micro in MICRO_CHOICES:
            tried = []
            for sp in sps:
                if seq % sp:
                    continue
                try:
                    bp = batchmod.derive(r.train.global_batch_tokens, seq, micro, t.world,
                                         batchmod.rows_per_sample(r), sp)
                except batchmod.BatchError:
                    continue  # must reach global_batch_tokens exactly
                tried.append(o := option(seq, micro, sp, bp.grad_accum))
                if o.fits:
                    break
            if tried:
                out.append(tried[-1])
            own = next((o for o in tried if o.recipe), None)
            if own is not None and own is not tried[-1]:
                out.append(own)  # the recipe's own degree, beside the smallest that fits
    return tuple(out)


def recommend(t: Target, opts: tuple[Option, ...]) -> Option | None:
    """Fastest per useful token (same global batch, so fastest per step) among what fits and truncates at most 1% of
    documents (seq_len >= the prepared data's p99; before `make data`, the recipe's seq_len). Ties (varlen attention
    costs the same at any seq_len): the recipe's own, then larger micro-batch (better GPU use), then longer rows.
    Nothing long enough fits: the longest that does.

    Time per step counts communication too (planner/time.py): across nodes, short rows can take longer than their
    FLOPs say. No peak known (CPU target): FLOPs. The recipe's own choice stands unless another saves more than
    RECOMMEND_GAIN: a smaller gain is inside the model's own uncertainty."""
    seq = t.r.data.seq_len
    fitting = [o for o in opts if o.fits]
    floor = min(t.docs["p99"], seq) if t.docs and t.docs.get("p99") else seq
    cands = [o for o in fitting if o.seq_len >= floor]

    def cost(o: Option) -> float:
        return o.seconds_per_step if o.seconds_per_step is not None else o.flops_per_step

    if cands:
        rec = min(cands, key=lambda o: (cost(o), not o.recipe, -o.micro_batch_size, -o.seq_len))
    else:
        rec = max(fitting, key=lambda o: (o.seq_len, o.micro_batch_size)) if fitting else None
    own = next((o for o in cands if o.recipe), None)
    if rec is not None and own is not None and cost(own) <= cost(rec) * (1 + RECOMMEND_GAIN):
        return own
    return rec


def suggestions(t: Target) -> tuple[Suggestion, ...]:
    """Nothing fits: the usual switches, one at a time at the recipe's seq_len, and the peak each gives."""
    seq, rows = t.r.data.seq_len, t.rows(1)
    out = []

    def tried(override: str | None, peak: int, slower: bool = False, gpus: int | None = None) -> Suggestion:
        return Suggestion(override=override, peak_bytes=peak, fits=peak <= t.capacity, slower=slower, gpus=gpus)

    if t.reference_copy:
        r = dataclasses.replace(t.r, rl=dataclasses.replace(t.r.rl, beta=0.0))
        out.append(tried("rl.beta=0", dataclasses.replace(t, r=r).memory(seq, rows)["peak"]))
    if not t.choice.liger and t.on_gpu:
        out.append(tried("train.liger=on", t.memory(seq, rows, choice=dataclasses.replace(t.choice, liger=True))["peak"]))
    if t.zero_stage == 3 and not t.zero.get("offload_optimizer"):
        z = {**t.zero, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        out.append(tried("train.zero.offload_optimizer={device: cpu}", t.memory(seq, rows, zero=z)["peak"], slower=True))
    for s in [x for x in SEQ_CHOICES if x < seq][::-1]:
        peak = t.memory(s, rows)["peak"]
        if peak <= t.capacity:
            out.append(tried(f"data.seq_len={s}", peak))
            break
    for sp in sequence_parallel_choices(t) if t.zero is not None else ():
        peak = t.memory(seq, rows, sp=sp)["peak"]
        if sp > t.sp and not seq % sp and peak <= t.capacity:
            out.append(tried(f"train.sequence_parallel={sp}", peak))
            break
    gpn = 2 * t.gpus_per_node
    out.append(tried(None, t.memory(seq, rows, gpus_per_node=gpn)["peak"], gpus=gpn * t.nodes))
    return tuple(out)
