"""The planner's time model (issue 30): each term against hand-computed values, the plan's time entry, and
the calibration table of public DeepSpeed measurements (docs/planner_time.md)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from zerotune import hardware
from zerotune.config import load_recipe
from zerotune.planner.compute import compute_plan
from zerotune.planner.report import format_plan, node_advice
from zerotune.planner import target
from zerotune.planner import time as tm

V100 = hardware.GPUS["v100-32gb"]
EDR1 = tm.CLUSTERS["v100-sxm2-1xedr"]
GB = 1e9


def job(**kw) -> tm.Job:
    base = dict(n_params=8_000_000_000, trainable=8_000_000_000, flops_micro=1.6e15, forward_share=0.25,
                tokens_micro=16384, grad_accum=480, gpus_per_node=8, nodes=1, dtype_bytes=2, zero_stage=3)
    return tm.Job(**{**base, **kw})


# --- the figures -------------------------------------------------------------------------------------

def test_every_figure_has_a_value_unit_and_source():
    for name, f in tm.FIGURES.items():
        assert f.value > 0 and f.unit and f.what and len(f.source) > 20, name


def test_cluster_bandwidths_come_from_the_figures():
    f = tm.F
    assert EDR1.intra == pytest.approx(6 * 25 * 0.8) == pytest.approx(f("nvlink2_v100_line") * f("nccl_efficiency"))
    assert EDR1.inter == pytest.approx(12.5 * 0.8)  # one EDR port per node
    assert tm.CLUSTERS["v100-sxm2-4xedr"].inter == pytest.approx(4 * 12.5 * 0.8)
    assert EDR1.host == pytest.approx(12.0 / 2)  # two SXM2 GPUs share a PCIe switch uplink
    assert EDR1.intra / EDR1.inter == pytest.approx(12)  # the "10-25x slower than NVLink"
    for name, gpu in hardware.GPUS.items():
        assert gpu.cluster is None if gpu.capability is None else gpu.cluster in tm.CLUSTERS, name


# --- each term by hand ------------------------------------------------------------------------------

def test_ring_collective_time():
    # 16 GB gathered over 8 ranks in a node at 120 GB/s: each rank receives 7/8 of it
    assert tm.collective_s(16 * GB, 8, EDR1, across_nodes=False) == pytest.approx(16 * 7 / 8 / 120)
    # across nodes the node's network (10 GB/s) is the slower link
    assert tm.collective_s(16 * GB, 32, EDR1, across_nodes=True) == pytest.approx(16 * 31 / 32 / 10)
    assert tm.collective_s(16 * GB, 1, EDR1, across_nodes=False) == 0


def test_ring_collective_is_nccls_own_model():
    # NCCL's tuner (src/graph/tuning.cc), ring: base + (ranks - nodes) in-node steps + (nodes - 1) network steps;
    # 384 V100s on 24 DGX-2 nodes: Simple 8.4 + 360 x 3.4 + 23 x 14 = 1,554.4 us, LL128 14 + 360 x 1.9 + 23 x 4 =
    # 790 us, LL 6.6 + 360 x 1.0 (an in-node step across nodes costs at least the 1 us network overhead) + 23 x 2.7
    # = 428.7 us; bandwidth 1, 0.92, 0.5 (LL capped at 20.4 GB/s beyond 2 nodes) of the bus's
    eight = tm.Cluster("dgx2-8x", "", intra=EDR1.intra, nic="ib_edr_line", nics=8, host=6.0, hbm=900.0, cpu_adam=1e9)
    bw = eight.inter * GB  # 80 GB/s per node: LL's half (40) is above its 20.4 cap, which binds
    for nbytes in (1e3, 75e6, 226e6, 1e9):
        share = nbytes * 383 / 384
        want = min(1554.4e-6 + share / bw, 790e-6 + share / (0.92 * bw), 428.7e-6 + share / 20.4e9)
        assert tm.ring_collective_s(nbytes, 384, 24, eight)[0] == pytest.approx(want)
    assert tm.ring_collective_s(1e3, 384, 24, eight)[1] == pytest.approx(428.7e-6)  # a few KB: LL
    assert tm.ring_collective_s(75e6, 384, 24, eight)[1] == pytest.approx(790e-6)  # 18B's 75 MB module: LL128
    # Llama-3.1-8B's 117 MB MLP matrix on one 8-GPU NVLink node: Simple (LL128's 8% less bandwidth costs more)
    assert tm.ring_collective_s(117e6, 8, 1, EDR1)[1] == pytest.approx((8.4 + 7 * 3.4) * 1e-6)
    # 4 MB on one node: LL128 over NVLink (14 + 7 x 1.9 us; between ~1 and ~7 MB it beats LL and Simple); on T4s
    # (PCIe) no LL128: Simple's 8.4 + 7 x 5.7 us
    assert tm.ring_collective_s(4e6, 8, 1, EDR1)[1] == pytest.approx((14 + 7 * 1.9) * 1e-6)
    assert tm.ring_collective_s(4e6, 8, 1, tm.CLUSTERS["t4-pcie-1xedr"])[1] == pytest.approx((8.4 + 7 * 5.7) * 1e-6)
    assert tm.ring_collective_s(1e9, 1, 1, EDR1) == (0.0, 0.0)


def test_latency_per_gathered_module_in_every_collective():
    # 226 modules: a forward and a backward gather and a reduce-scatter each per micro-step, in the passes' traffic
    numels = (8_000_000_000 // 226,) * 226
    plain = tm.step_time(job(nodes=4, grad_accum=120), EDR1, 125.0, 0.35)
    lat = tm.step_time(job(nodes=4, grad_accum=120, module_numels=numels), EDR1, 125.0, 0.35)
    one, one_lat = tm.ring_collective_s(2 * numels[0], 32, 4, EDR1)
    pm = lat["per_micro_step"]
    assert pm["collectives"] == 3 * 226 and pm["latency_s"] == pytest.approx(3 * 226 * one_lat)
    assert pm["communication_s"] == pytest.approx(3 * 226 * one)
    assert pm["communication_s"] - plain["per_micro_step"]["communication_s"] == pytest.approx(3 * 226 * one_lat)
    assert "collectives" not in plain["per_micro_step"]
    # adapters: their few gradients fill whole reduce buckets (3 here), the gathers stay per module
    lora = tm.step_time(job(nodes=4, grad_accum=120, module_numels=numels, trainable=42_000_000,
                            reduce_bucket=16_777_216), EDR1, 125.0, 0.35)["per_micro_step"]
    assert lora["collectives"] == 2 * 226 + 3


def test_gathered_modules_follow_the_persistence_threshold():
    import json

    from conftest import REPO

    shape = target.model_shape(load_recipe("llama8b_zero3"))
    zero = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
    # the shipped config's "auto", as transformers fills it: threshold 10 x hidden = 40,960 (every projection, the
    # embedding and the untied lm_head; not the norms, 4,096 each), reduce bucket hidden^2
    numels, bucket = shape.zero3_modules(zero)
    assert len(numels) == 32 * 7 + 2 and sum(numels) == shape.n_params - (2 * 32 + 1) * 4096
    assert bucket == 4096 ** 2
    # a threshold of 20M keeps q and o (16.8M) resident too: gate, up, down (58.7M), embedding and lm_head remain
    assert len(shape.zero3_modules({**zero, "stage3_param_persistence_threshold": 20_000_000})[0]) == 32 * 3 + 2
    # a value DeepSpeed would refuse at launch is refused by the plan, naming the key (the CLI: one line, exit 2)
    from zerotune.errors import UserError

    with pytest.raises(UserError, match=r"train\.zero\.reduce_bucket_size"):
        shape.zero3_modules({**zero, "reduce_bucket_size": "big"})
    t = compute_plan(load_recipe("llama8b_zero3")).time
    assert t.per_micro_step.collectives == 3 * (32 * 7 + 2)


def test_one_node_step_by_hand():
    j = job()
    t = tm.step_time(j, EDR1, 125.0, 0.35)
    c = 1.6e15 / (125e12 * 0.35)  # 36.57 s per micro-step
    g = 16e9 * 7 / 8 / 120e9      # one gather (and one reduce-scatter) of 16 GB, 0.117 s
    cf, cb, mf, mb = c / 4, 3 * c / 4, g, 2 * g
    micro = max(cf, mf) + 0.25 * min(cf, mf) + max(cb, mb) + 0.25 * min(cb, mb)
    assert t["terms"]["compute"] == pytest.approx(480 * c)
    assert t["terms"]["communication"] == pytest.approx(480 * (micro - c))  # 0.25 x 3 g per micro-step
    assert t["terms"]["communication"] == pytest.approx(480 * 0.25 * 3 * g)
    assert t["terms"]["optimizer"] == pytest.approx(1e9 / 2e9)  # 8e9 / 8 GPUs at 2e9 parameters/s
    assert t["terms"]["fixed"] == pytest.approx(480 * 16384 * 1.1e-6 + tm.F("bookkeeping_s"))  # fetch, no save
    assert t["terms"]["host"] == 0.0  # no layers given: no host work
    assert t["seconds_per_step"] == pytest.approx(sum(t["terms"].values()))
    assert t["dominant"] == "compute"
    assert t["crossover_tokens"] == pytest.approx(16384 * 3 * g / c)


def test_communication_bound_micro_step_by_hand():
    # 4 nodes, 512 tokens per GPU: the traffic (3 x 16 GB x 31/32 at 10 GB/s) outlasts the compute
    j = job(nodes=4, grad_accum=1, flops_micro=8 * 8e9 * 512, tokens_micro=512)
    t = tm.step_time(j, EDR1, 125.0, 0.35)
    c = 8 * 8e9 * 512 / (125e12 * 0.35)
    g = 16e9 * 31 / 32 / 10e9
    micro = max(c / 4, g) + 0.25 * min(c / 4, g) + max(3 * c / 4, 2 * g) + 0.25 * min(3 * c / 4, 2 * g)
    assert t["terms"]["communication"] == pytest.approx(micro - c)
    assert t["dominant"] == "communication" and t["communication_over_compute"] > 1


def test_host_work_by_hand():
    """ZeRO-3's host work per pass (layers x the figure; backward 2 x with recompute) costs only what the pass's GPU
    work does not cover; at any world size (one rank gathers nothing, its hooks run); never outside ZeRO-3."""
    h = tm.F("zero3_host_s_per_layer_pass")
    for nodes, gpn in ((1, 8), (1, 1)):
        short = job(layers=32, nodes=nodes, gpus_per_node=gpn, grad_accum=4, flops_micro=8 * 8e9 * 64, tokens_micro=64)
        t = tm.step_time(short, EDR1, 125.0, 0.35)
        bare = tm.step_time(dataclasses.replace(short, layers=0), EDR1, 125.0, 0.35)
        pm, pb = t["per_micro_step"], bare["per_micro_step"]
        assert pm["host_s"] == pytest.approx(3 * 32 * h)
        if gpn == 1:  # no traffic: each pass's GPU work is its compute
            c = pb["compute_s"]
            exposed = max(32 * h - c / 4, 0) + max(64 * h - 3 * c / 4, 0)
            assert pm["host_exposed_s"] == pytest.approx(exposed) and exposed > 0
        assert t["terms"]["host"] == pytest.approx(4 * pm["host_exposed_s"]) and t["terms"]["host"] > 0
        assert t["seconds_per_step"] == pytest.approx(bare["seconds_per_step"] + t["terms"]["host"])
    # 16K rows: the kernels outlast the host work, which costs nothing
    t = tm.step_time(job(layers=32), EDR1, 125.0, 0.35)
    assert t["per_micro_step"]["host_s"] > 0 and t["terms"]["host"] == 0.0
    assert tm.step_time(job(layers=32, zero_stage=2), EDR1, 125.0, 0.35)["terms"]["host"] == 0.0


def test_hpz_keeps_all_but_one_gather_in_the_node():
    j = job(nodes=4, grad_accum=120, hpz=8)
    t = tm.step_time(j, EDR1, 125.0, 0.35)["per_micro_step"]
    world = 16e9 * 31 / 32 / 10e9
    local = 16e9 * 7 / 8 / 120e9
    assert t["forward_gather_s"] == pytest.approx((world + 119 * local) / 120)
    assert t["backward_gather_s"] == pytest.approx(local)
    assert t["reduce_scatter_s"] == pytest.approx(world)  # gradients still cross the world
    assert tm.hpz_bytes(8_030_261_248, 2, 8) == 2 * 1_003_782_656  # the secondary copy: 2 B x N / 8


def test_offload_terms_by_hand():
    j = job(gpus_per_node=4, grad_accum=960, offload_optimizer=True)
    t = tm.step_time(j, EDR1, 125.0, 0.35)
    per_gpu = 8e9 / 4
    assert t["per_micro_step"]["offload_grad_pcie_s"] == pytest.approx(8 * per_gpu / 6e9)
    assert t["terms"]["optimizer"] == pytest.approx(8e9 / tm.F("cpu_adam") + 2 * per_gpu / 6e9)


def test_without_zero3_one_all_reduce_per_step():
    j = job(zero_stage=0, gpus_per_node=2, grad_accum=16, trainable=40_000_000)
    t = tm.step_time(j, EDR1, 125.0, 0.35)
    assert t["terms"]["communication"] == pytest.approx(2 * 80e6 * 1 / 2 / 120e9)
    single = tm.step_time(job(zero_stage=0, gpus_per_node=1, grad_accum=16), EDR1, 125.0, 0.35)
    assert single["terms"]["communication"] == 0


def test_zero2_reduces_gradients_every_micro_step():
    """Stage 2 partitions gradients: reduced in every micro-step's backward (deepspeed 0.19.8
    stage_1_and_2.py:2293-2295), not once per step as stage 1 / DDP under no_sync."""
    j = job(zero_stage=2, gpus_per_node=2, grad_accum=16, trainable=40_000_000)
    t = tm.step_time(j, EDR1, 125.0, 0.35)
    rs = 80e6 * 1 / 2 / 120e9
    assert t["per_micro_step"]["reduce_scatter_s"] == pytest.approx(rs)
    assert t["step_communication_s"] == 0
    assert "step_gradient_all_reduce_s" not in t["per_micro_step"]
    stage1 = tm.step_time(job(zero_stage=1, gpus_per_node=2, grad_accum=16, trainable=40_000_000), EDR1, 125.0, 0.35)
    assert stage1["step_communication_s"] == pytest.approx(2 * rs) and "reduce_scatter_s" not in stage1["per_micro_step"]


def test_save_is_paid_every_save_steps():
    t = tm.step_time(job(save_s=112.0, save_steps=2), EDR1, 125.0, 0.35)
    assert t["fixed_parts"]["save_s"] == pytest.approx(56.0)


# --- the plan's time entry ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan8b():
    return compute_plan(load_recipe("llama8b_zero3"))


def test_plan_json_exposes_terms_and_total(plan8b):
    t = plan8b.time
    assert [k for k, _ in t.terms.items()] == ["compute", "communication", "host", "optimizer", "fixed"]
    assert t.seconds_per_step == pytest.approx(sum(v for _, v in t.terms.items())) == pytest.approx(t.terms.total)
    # the compute term is the former estimate: FLOPs / (GPUs x peak x MFU), MFU of the kernels alone
    assert t.terms.compute == pytest.approx(t.flops_per_step / (8 * 125e12 * 0.35))
    assert t.dominant == "compute"
    # every option's hours now include communication and fixed costs
    own = next(o for o in plan8b.options if o.recipe)
    assert own.seconds_per_step == pytest.approx(t.seconds_per_step)


def test_8b_nodes_table(plan8b):
    nt = plan8b.time.nodes
    rows = {row.nodes: row for row in nt.rows}
    one, four = rows[1].on("v100-sxm2-1xedr"), rows[4].on("v100-sxm2-1xedr")
    assert (rows[1].grad_accum, rows[4].grad_accum) == (480, 120)
    assert 3 < one.seconds_per_step / 3600 < 4  # per-document attention (sdpa_docs); 4.97 h with the dense mask
    # at 16K tokens per micro-step compute dominates even across nodes: 4 nodes are nearly 4x, not exactly
    assert 3.5 < four.speedup < 4
    assert four.communication_over_compute > 10 * one.communication_over_compute
    assert four.crossover_tokens < 16384 < 10 * four.crossover_tokens
    # hpZ's secondary copy fits at 4 nodes (32-way sharding frees more than it costs)
    assert rows[4].hpz_fits and rows[4].hpz_extra_bytes == tm.hpz_bytes(8_030_261_248, 2, 8)
    assert four.hpz_seconds_per_step < four.seconds_per_step
    c = plan8b.cluster
    assert any("hpZ" in a for a in node_advice(nt, c.gpus_per_node, c.capacity_bytes, 16384))
    text = format_plan(plan8b)
    for needle in ("communication", "optimizer", "fixed", "dominated by compute", "nodes (same", "overtakes compute"):
        assert needle in text, needle


def test_offload_on_four_gpus():
    t = compute_plan(load_recipe("llama8b_zero3_offload")).time
    pm = t.per_micro_step
    assert pm.offload_grad_pcie_s < pm.compute_s  # hidden at 16K tokens per micro-step
    assert 6 < t.seconds_per_step / 3600 < 8 and t.dominant == "compute"
    assert t.terms.optimizer == pytest.approx(8_030_261_248 / tm.F("cpu_adam") + 2 * 8_030_261_248 / 4 / 6e9)


def test_unknown_cluster_is_refused():
    from zerotune.planner.target import PlanError

    with pytest.raises(PlanError, match="cluster"):
        compute_plan(load_recipe("llama8b_zero3"), cluster="infiniband-9000")
    four = compute_plan(load_recipe("llama8b_zero3"), nodes=4, cluster="v100-sxm2-4xedr").time
    assert four.cluster == "v100-sxm2-4xedr" and four.inter_node_gbs == pytest.approx(40)


# --- calibration: public measurements beside the model's prediction ------------------------------------
# Tolerance: +-25% of the measured time. The sources spread about that much in the figures the model rests on:
# NCCL efficiency 0.75-0.96 of line rate across the four measurements cited for it (nccl_efficiency), compute
# efficiency 0.35 (the planner's V100 default) against >= 0.44 that Megatron-DeepSpeed reaches on the same
# V100s (ZeRO++ at 800 Gb/s: 54-55 TFLOPS incl. its own communication), CPU Adam 1.41-1.62e9 parameters/s.
TOL = 0.25


def megatron_flops(tokens: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-DeepSpeed's FLOPs per sequence with activation checkpointing (the TFLOPS its logs report):
    24 x 4 x s x L x h^2 x (1 + s / (6h) + V / (16 L h)); full (masked) attention, as Megatron computes it."""
    s = tokens
    return 24 * 4 * s * layers * hidden ** 2 * (1 + s / (6 * hidden) + vocab / (16 * layers * hidden))


# ZeRO++ blog (deepspeedai/DeepSpeed blogs/zeropp, figures eval1-eval3.png; arXiv 2306.10209): Megatron-DeepSpeed
# GPT, ZeRO-3 baseline (no ZeRO++), fp16, activation checkpointing, 384 V100-SXM3 (24 DGX-2 nodes of 16, NVSwitch),
# inter-node InfiniBand ports of 100 Gb/s. 18B = 40 layers, hidden 6144 (docs/_tutorials/zeropp.md), vocab 50,257.
# (source, setup, ports per node, tokens per GPU per micro-step, measured TFLOPS per GPU)
ZEROPP = [
    ("ZeRO++ blog eval2.png", "18B, 384 V100, 1x 100 Gb/s IB, 1K tokens/GPU", 1, 1024, 14),
    ("ZeRO++ blog eval2.png", "18B, 384 V100, 1x 100 Gb/s IB, 2K tokens/GPU", 1, 2048, 26),
    ("ZeRO++ blog eval3.png", "18B, 384 V100, 200 Gb/s, 2K tokens/GPU", 2, 2048, 37),
    ("ZeRO++ blog eval1.png", "18B, 384 V100, 4x 100 Gb/s IB, 2K tokens/GPU", 4, 2048, 40),
    ("ZeRO++ blog eval3.png", "18B, 384 V100, 800 Gb/s, 2K tokens/GPU", 8, 2048, 47),
    ("ZeRO++ blog eval1.png", "18B, 384 V100, 4x 100 Gb/s IB, 1K tokens/GPU", 4, 1024, 25),
]
# What ZeRO-3 gathers per pass in Megatron-DeepSpeed's GPT, module by module: the word and position embeddings
# (the output layer shares the word embeddings), then per layer query_key_value, dense, dense_h_to_4h,
# dense_4h_to_h (their biases and the layer norms, 6,144-24,576 parameters, stay under DeepSpeed's default
# stage3_param_persistence_threshold of 1e5; the ZeRO++ tutorial's config sets reduce_bucket_size 1e7, under each
# weight: one reduce-scatter per module).
MEGATRON_MODULES = (50257 * 6144, 2048 * 6144) + (3 * 6144 ** 2, 6144 ** 2, 4 * 6144 ** 2, 4 * 6144 ** 2) * 40
# The 4x 1K row is outside the tolerance: its extra 1K tokens per GPU over the 2K sibling on the same cluster (40
# TFLOPS) cost only 1.65 s, 95 TFLOPS at the margin (76% of the V100's peak), so ~2 s of it is fixed cost per
# micro-step at 384 ranks. NCCL's per-collective latency (its own model and protocol choice, one collective per
# gathered module) carries ~0.3 s of that: -31% -> -26%. The rest (stragglers at 384 ranks, anything else fixed
# per micro-step) is not modelled.
SHORT_ROW = "18B, 384 V100, 4x 100 Gb/s IB, 1K tokens/GPU"


def dgx2(ports: int) -> tm.Cluster:
    return tm.Cluster(f"dgx2-{ports}xedr", "16x V100-SXM3 NVSwitch", intra=EDR1.intra, nic="ib_edr_line",
                      nics=ports, host=tm.F("pcie3_host_measured"), hbm=tm.F("gpu_hbm_v100"), cpu_adam=tm.F("cpu_adam"))


def zeropp_prediction(ports: int, tokens: int, overlap: float | None = None,
                      modules: tuple = MEGATRON_MODULES, layers: int = 0) -> tuple[float, float]:
    """(predicted, measured-equivalent) seconds per iteration: compute + communication + optimizer (the fixed
    terms are the HF Trainer's; Megatron-DeepSpeed has none of them)."""
    L, h, V = 40, 6144, 50257
    n = 12 * L * h * h + (V + 2048) * h
    flops = megatron_flops(tokens, L, h, V)
    j = tm.Job(n_params=n, trainable=n, flops_micro=flops, forward_share=0.25, tokens_micro=tokens, grad_accum=1,
               gpus_per_node=16, nodes=24, dtype_bytes=2, zero_stage=3, module_numels=modules, layers=layers)
    t = tm.step_time(j, dgx2(ports), V100.peak_tflops, V100.default_mfu, overlap)
    return t["seconds_per_step"] - t["terms"]["fixed"], flops


@pytest.mark.parametrize("src,setup,ports,tokens,tflops", ZEROPP)
def test_calibration_zeropp_zero3_baseline(src, setup, ports, tokens, tflops):
    predicted, flops = zeropp_prediction(ports, tokens)
    measured = flops / (tflops * 1e12)
    err = predicted / measured - 1
    if setup == SHORT_ROW:  # outside, by less than without the latency term (31% optimistic): pinned, not tuned to
        assert -0.3 < err < -TOL, (setup, round(err, 3))
        assert zeropp_prediction(ports, tokens, modules=())[0] / measured - 1 < -0.3
    else:
        assert abs(err) <= TOL, (setup, round(err, 3))
    # DeepSpeed's host work (issue 53) hides behind 18B-wide layers' kernels on every row, the 4x 1K one included
    assert zeropp_prediction(ports, tokens, layers=40)[0] == pytest.approx(predicted)
    # the former model (compute only) is optimistic beyond the tolerance where the traffic dominates
    compute_only = flops / (V100.peak_tflops * 1e12 * V100.default_mfu)
    if ports == 1:
        assert compute_only / measured - 1 < -TOL, setup


# CPU Adam (DeepSpeedCPUAdam, one process using the host's cores): (source, setup, parameters, measured s)
CPU_ADAM = [
    ("DeepSpeed ZeRO-Offload tutorial log", "10.28B GPT-2, 1 V100-SXM3, DGX-2 host (source of cpu_adam)",
     12 * 50 * 4096 ** 2 + (50257 + 1024) * 4096, (6.47857 + 6.21736) / 2),
    ("DeepSpeed PR #735", "11.6B GPT-2, 'optimizer time from 56 seconds to 8.2 seconds'", 11.6e9, 8.2),
]


@pytest.mark.parametrize("src,setup,params,seconds", CPU_ADAM)
def test_calibration_cpu_adam(src, setup, params, seconds):
    assert abs(params / tm.F("cpu_adam") / seconds - 1) <= TOL, setup


def test_cpu_adam_within_a_measured_whole_step():
    # DeepSpeed PR #7474: Qwen2.5-3B (3.09B) on 2 A100-40GB with optimizer offload, 128-core host: 2383 ms per
    # step with --bind_cores_to_rank, forward and backward included: CPU Adam alone must take less
    assert 3.09e9 / tm.F("cpu_adam") < 2.383


def test_overlap_is_not_tuned_to_one_row():
    # every 2K row and the 1x 1K row stay within tolerance for any overlap from 0.6 to 1.0, not only at the
    # stated 0.75; the 4x 1K row (the model's weakest, SHORT_ROW) only up to 0.75 (docs/planner_time.md)
    for overlap in (0.6, 0.7, 0.8, 0.9, 1.0):
        for src, setup, ports, tokens, tflops in ZEROPP:
            if setup == SHORT_ROW:
                continue
            predicted, flops = zeropp_prediction(ports, tokens, overlap)
            assert abs(predicted / (flops / (tflops * 1e12)) - 1) <= TOL, (overlap, setup)
    assert math.isclose(tm.F("overlap"), 0.75)


# --- GPU rows measured by `make gpu-check` beside the plan for the same card and configuration ------------------
GPU_ROWS = [  # (results file, row, seq): the 1B-shaped ZeRO-3 rows of the H200 lent on 2026-11-26 (bf16, sdpa)
    ("h200_seq2048_4096.json", "1B seq 2048: train", 2048),
    ("h200_seq2048_4096.json", "1B seq 4096: train", 4096),
    ("h200_seq16384.json", "1B seq 16384: train", 16384),
]
GPU_TOL = 0.35  # issue 41: every measured GPU row within +-35%


@pytest.mark.parametrize("results,row,seq", GPU_ROWS)
def test_the_plan_meets_every_timed_gpu_row(results, row, seq, tmp_path):
    """The plan's seconds per optimizer step for the configuration a gpu-check row ran (its card, precision,
    attention, shape, GA 2, world size 1) against the seconds it measured (bench/results/gpu_check/). These rows
    ran before V100 emulation: bf16 and SDPA with the dense packed mask (cuDNN), so they test the time model's
    terms on that card, not a V100's kernels (docs/planner_time.md)."""
    import json
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check as gc

    measured = next(r for r in json.loads((REPO / "bench" / "results" / "gpu_check" / results).read_text())["rows"]
                    if r["check"] == row)
    assert measured["status"] == "ok" and "bf16, sdpa + packed mask" in measured["detail"]
    d = gc.zero3_recipe("h200-row", gc.write_config(tmp_path / "1b.json", gc.shape_config("1b")), tmp_path / "out",
                        seq, 3, attention="sdpa", plan_gpu="h200")
    d["train"]["precision"] = "bf16"
    t = compute_plan(gc.recipe(d), gpu="h200", gpus_per_node=1, nodes=1).time
    assert t.attention_kind == "dense" and t.grad_accum == 2
    err = t.seconds_per_step / measured["seconds"] - 1
    assert abs(err) <= GPU_TOL, (row, round(err, 3))


# DeepSpeed's own stage-3 sizes (a plain {"stage": 3} config): what the short-row regime is shown with
DEEPSPEED_DEFAULT_SIZES = ["train.zero.stage3_param_persistence_threshold=100000",
                           "train.zero.reduce_bucket_size=500000000", "train.zero.stage3_prefetch_bucket_size=50000000"]


def test_8b_at_512_tokens_host_work_and_its_no_overlap_bound():
    """The short-row regime of docs/planner_time.md: llama8b_zero3 at 512 tokens x micro-batch 1 on one 8 x V100
    node. The host work (3 passes x 32 layers) is most of the GPU's work per micro-step; the plan hides it (the host
    runs a pass ahead) and states what the step would take if none of it overlapped."""
    t = compute_plan(load_recipe("llama8b_zero3", ["data.seq_len=512", *DEEPSPEED_DEFAULT_SIZES])).time
    pm = t.per_micro_step
    assert pm.host_s == pytest.approx(3 * 32 * tm.F("zero3_host_s_per_layer_pass"))
    assert pm.collectives == 3 * (32 * 7 + 2)  # 226 gathered modules (norms stay resident), a reduce-scatter each
    assert 0.5 < pm.host_s / pm.compute_s < 1.5 and t.terms.host == 0.0  # each pass's GPU work covers its host work
    long = compute_plan(load_recipe("llama8b_zero3")).time
    per_token = t.seconds_per_step / t.tokens_per_step
    assert 1.05 < per_token / (long.seconds_per_step / long.tokens_per_step) < 1.3
    no_overlap = (t.seconds_per_step + t.grad_accum * pm.host_s) / t.tokens_per_step
    assert no_overlap / per_token > 1.4
    assert "more per step if none of it overlapped" in format_plan(compute_plan(load_recipe(
        "llama8b_zero3", ["data.seq_len=512", *DEEPSPEED_DEFAULT_SIZES])))


def test_validation_and_samples_wait_for_the_host_work():
    """Every forward under ZeRO-3 runs the hooks: a validation row or a sampled token takes at least a pass's host
    work, not only in training."""
    p = compute_plan(load_recipe("llama8b_zero3"))
    host = tm.zero3_host_pass_s(3, 32)
    assert p.phases.validation.time.per_row_s > host > 0  # a 16K row: the kernels are longer
    assert not p.phases.samples.gather_once and p.phases.samples.time.per_token_s == pytest.approx(host)


def test_the_host_figures_are_the_benchs():
    """planner/time.py states the figures bench/bench_zero3_host.py measured (bench/results/zero3_host.json), to the
    two digits it gives them; LoRA's layer (adapters.py's leaves) costs more than a full fine-tune's."""
    import json

    from conftest import REPO

    fits = json.loads((REPO / "bench" / "results" / "zero3_host.json").read_text())["fits"]
    for key, name in (("llama", "zero3_host_s_per_layer_pass"), ("llama_lora", "zero3_host_s_per_lora_layer_pass")):
        assert tm.F(name) == pytest.approx(fits[key]["host_s_per_layer_pass"], rel=0.02), name
    assert tm.F("zero3_host_s_per_lora_layer_pass") > tm.F("zero3_host_s_per_layer_pass")
    lora = compute_plan(load_recipe("llama8b_lora_zero3")).time.per_micro_step
    assert lora.host_s == pytest.approx(3 * 32 * tm.F("zero3_host_s_per_lora_layer_pass"))


def test_the_docs_list_every_figure_with_its_value():
    """docs/planner_time.md's table of figures mirrors FIGURES: every name, with the value the model uses."""
    import re

    from conftest import REPO

    text = (REPO / "docs" / "planner_time.md").read_text()
    for name, f in tm.FIGURES.items():
        m = re.search(rf"^\| `{name}` \| ([^|]+) \|", text, re.M)
        assert m and m.group(1).strip() == f"{f.value:g}", name
