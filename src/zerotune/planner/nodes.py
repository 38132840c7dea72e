"""The recipe's own global batch on 1, 2, 4 and 8 nodes of the same kind (GA from the world size), with and without
ZeRO++ hierarchical partitioning (zero_hpz_partition_size = GPUs per node) and its memory, on the GPU's cluster
type and the alternatives beside it (planner/time.py CLUSTERS). report.py says what the table advises."""

from __future__ import annotations

import dataclasses

from .. import hardware
from . import time as timemodel
from .records import NodeCluster, NodeRow, NodeTable
from .target import Target

NODE_COUNTS = (1, 2, 4, 8)
HPZ_WORTH = 0.05  # advise hpZ when it saves at least this share of the step: less is within the model's error


def node_table(t: Target) -> NodeTable:
    r, gpn = t.r, t.gpus_per_node
    seq, per_micro = r.data.seq_len, t.rows(r.train.micro_batch_size)
    clusters = (t.cluster, *timemodel.ALTERNATIVES.get(t.cluster, ()))
    hpz_extra = timemodel.hpz_bytes(t.shape.n_params, hardware.dtype_bytes(t.choice.precision), gpn)
    rows = []
    for n in NODE_COUNTS:
        world = gpn * n
        peak = t.memory(seq, per_micro, nodes=n)["peak"]
        entries = []
        for c in clusters:
            base = t.step_time(seq, per_micro, world, hpz=1, cluster=c)
            hp = t.step_time(seq, per_micro, world, hpz=gpn, cluster=c) if n > 1 and t.zero_stage == 3 else None
            entries.append(NodeCluster(
                cluster=c, seconds_per_step=base.seconds_per_step, terms=base.terms,
                per_micro_step=base.per_micro_step, fixed_parts=base.fixed_parts,
                communication_over_compute=base.communication_over_compute,
                crossover_tokens=base.crossover_tokens,
                tokens_per_s_per_gpu=r.train.global_batch_tokens / base.seconds_per_step / world,
                hpz_seconds_per_step=hp.seconds_per_step if hp else None, hpz_terms=hp.terms if hp else None))
        rows.append(NodeRow(nodes=n, world_size=world, grad_accum=t.grad_accum(seq, per_micro, world),
                            exact_batch=r.train.global_batch_tokens % (seq * per_micro * world) == 0,
                            peak_bytes=peak, fits=peak <= t.capacity, hpz_extra_bytes=hpz_extra if n > 1 else 0,
                            hpz_fits=peak + hpz_extra <= t.capacity, clusters=tuple(entries)))
    one = {c.cluster: c.seconds_per_step for c in rows[0].clusters}
    rows = [dataclasses.replace(row, clusters=tuple(
        dataclasses.replace(c, speedup=one[c.cluster] / c.seconds_per_step if c.seconds_per_step else None)
        for c in row.clusters)) for row in rows]
    return NodeTable(cluster=t.cluster, clusters=clusters, rows=tuple(rows), hpz_worth=HPZ_WORTH)
