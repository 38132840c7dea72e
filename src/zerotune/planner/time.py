"""Time per optimizer step of HF Trainer + DeepSpeed ZeRO-3 (issue 30): compute, communication,
optimizer and fixed costs, from the one table of figures below (FIGURES, each with its source).

    t_step = GA x t_micro + t_optimizer + t_fixed
    t_micro = sum over the forward and the backward pass of  max(g, h),   g = max(c, m) + (1 - OVERLAP) x min(c, m)

c is the pass's compute: its FLOPs on one GPU / (peak x MFU). MFU here is the efficiency of the kernels
alone (matmuls, attention, Liger) with nothing else running: communication, the optimizer and the fixed
costs are separate terms, so the MFU figures of the GPU table (hardware.GPUS) are not meant to absorb them.
m is the pass's traffic on the slowest link it crosses (a ring collective of S bytes over R ranks moves
S x (R-1)/R through every rank and, across nodes, through every node's network cards; nccl-tests calls the
rate it sustains "bus bandwidth"). What ZeRO-3 moves per micro-step, from deepspeed 0.19.8:

  forward    all-gather of every parameter in the model dtype (partition_parameters.py _all_gather_dtype,
             communication in the parameters' dtype; partitioned_param_coordinator.py fetch_sub_module)
  backward   all-gather again: gradient checkpointing's recompute and the backward of a layer share one
             gather, because the layer's backward comes within stage3_max_reuse_distance (1e9 parameters in
             configs/deepspeed/zero3.json) of its recompute (coordinator.__params_to_release keeps it; frozen
             LoRA bases through ds_recompute_parameters). That needs a complete trace: on the first step, and
             after any "Invalidate trace cache" (DeepSpeed #6870, #5006), every parameter is released
             (partitioned_param_coordinator.py:498-499) and recompute and backward gather separately: three
             gathers per micro-step, a third more traffic than planned; reduce-scatter of the gradients in
             communication_data_type (engine.py: fp16 under fp16, bf16 under bf16; stage3.py
             __avg_scatter_grads),
             on every micro-step, also under gradient accumulation (stage3.py partition_grads accumulates
             the scattered partitions, micro_step_id)
  offload    under offload_optimizer the accumulated fp32 gradient partition lives in pinned host memory
             (stage3.py:791-795, device = cpu): every micro-step copies the new partition into it and back to
             the GPU (the first) or copies it to the GPU, adds and copies it back (the others; stage3.py
             partition_grads, "adding directly to cpu is very slow"): 8 B per partitioned parameter over
             PCIe per micro-step, on the reduction stream (overlappable like the collectives).
  hpZ        zero_hpz_partition_size = h keeps a secondary copy of the parameters partitioned over h ranks
             (partition_parameters.py _partition_param_sec). It is made on the first release of each
             parameter and dropped only after the optimizer step (deepspeed 0.19.8 stage3.py:2846, _post_step ->
             invalidate_secondary_tensor; after a checkpoint load, :3848), and
             every gather that finds it uses the h-rank group (partition_parameters.py:1571-1574). So per
             optimizer step one forward gather crosses the world, the other 2 x GA - 1 stay inside the node;
             gradients still reduce-scatter over the world. Memory: 2 B x parameters / h per GPU. Reported
             against it: no speedup in practice (DeepSpeed #4386, #4886) and an fp16 loss blow-up with
             reentrant checkpointing, this recipe's setup (#7164, open): the plan never turns it on by itself.

h is the pass's host work under ZeRO-3: DeepSpeed's Python for every module of every layer (its hooks, fetch and
release with the trace, each collective's call), measured here per layer and pass on HF Llama's module tree
(zero3_host_s_per_layer_pass; the forward pass 1 x, the backward pass 2 x with recompute). It runs ahead of the
GPU's queue and costs time only where the pass's kernels and transfers are shorter: short rows, LoRA, small
micro-batches. Reported as its own term, `host`, the part the GPU's work does not cover. Optimistic in backward,
where DeepSpeed holds the host within 2 outstanding reduce-scatters of the compute (stage3.py:1664-1667): the
report also prints the step with none of it overlapped.

Ignored, with their size: parameters below stage3_param_persistence_threshold stay resident (Llama's norms,
< 0.01% of the bytes); parameters kept across the forward/backward turnaround (at most
stage3_max_reuse_distance = 1e9 parameters: <= 6% of one micro-step's gather bytes for 8B); the host work of the
model's ends (embedding, final norm, head: 3 modules against 9 per layer).

Per-collective latency: ZeRO-3 moves the model module by module (Job.module_numels: a gather per gathered module
and pass, a reduce-scatter per module's gradients), and each collective costs what NCCL's own tuner says it does
(NCCL_RING: its latency and bandwidth per protocol, the cheapest one; 678 collectives, 0.02 s per 8B micro-step on
one node, 0.10 s on 4).

OVERLAP is the share of the shorter of compute and communication that runs concurrently. DeepSpeed
prefetches the next modules' gathers (stage3_prefetch_bucket_size) and, with overlap_comm, reduce-scatters
on a side stream while backward continues; NCCL's kernels share the SMs and HBM with the compute, so the
overlap is not complete. The value is stated below with the measurements it is consistent with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    what: str
    source: str


# Every number the time model uses, once. The compute term's peak TFLOPS and MFU live in hardware.GPUS (the
# GPU table); the checkpoint write rate in plan.SAVE_BYTES_PER_S (shared with the preemption plan).
FIGURES: dict[str, Figure] = {
    # --- links -------------------------------------------------------------------------------------
    "nccl_efficiency": Figure(
        0.8, "busbw / line rate", "share of a link's line rate NCCL's ring collectives sustain",
        "sjeaugey (NCCL), NVIDIA/nccl-tests#212: 'with the protocol overhead (~20%) NCCL can get an effective "
        "NVLink bandwidth of 370GB/s' of 450; across nodes: DGX-1 with 4x EDR reaches ~40 of 50 GB/s all-reduce "
        "busbw (NVIDIA GTC 2017 S7155, quoted in NVIDIA/nccl-tests#29); 8x100 Gb RoCE 600 of 800 Gb/s "
        "(NVIDIA/nccl#495); 3 nodes 8xA100 4x HDR: 84.8 average, 96 peak of 100 GB/s (NVIDIA/nccl-tests#119)"),
    "nvlink2_v100_line": Figure(
        150.0, "GB/s per GPU per direction", "V100-SXM2: 6 NVLink2 links x 25 GB/s per direction",
        "NVIDIA DGX-1 V100 description (hybrid cube-mesh, 'three interwoven rings of single NVLink "
        "connections'); NVIDIA NVLink page: 'six NVLink connections ... 300 GB/s' bidirectional"),
    "nvlink3_a100_busbw": Figure(
        200.0, "GB/s", "8xA100-SXM4 NVLink3 nccl-tests busbw (measured)",
        "NVIDIA/nccl-tests#149: 'the nccl tests show a busbw of ~200 GB/s' (HPE Apollo 6500, 8xA100-80GB); "
        "(nccl-tests#178's 208 GB/s is a 2-GPU NV12-bridged pair, not an 8-GPU board: not used)"),
    "nvlink4_h100_busbw": Figure(
        360.0, "GB/s", "8xH100-SXM5 NVLink4 nccl-tests all_gather busbw (measured)",
        "NVIDIA/nccl-tests#326: ~360 GB/s all_gather, sjeaugey: '360 GB/s is exactly what we'd expect on "
        "H100'; nccl-tests#212: 370 GB/s effective"),
    "pcie3_x16_line": Figure(
        15.75, "GB/s per direction", "PCIe 3.0 x16 line rate (8 GT/s x 16 lanes x 128/130)",
        "PCI-SIG PCIe 3.0 base specification; used for T4 peer traffic (no NVLink)"),
    "ib_edr_line": Figure(12.5, "GB/s per port", "InfiniBand EDR, 100 Gb/s per port",
                          "IBTA / NVIDIA ConnectX-5 datasheet"),
    "ib_hdr_line": Figure(25.0, "GB/s per port", "InfiniBand HDR, 200 Gb/s per port",
                          "IBTA / NVIDIA ConnectX-6 datasheet"),
    "ib_ndr_line": Figure(50.0, "GB/s per port", "InfiniBand NDR, 400 Gb/s per port",
                          "IBTA / NVIDIA ConnectX-7 datasheet"),
    "pcie3_host_measured": Figure(
        12.0, "GB/s per direction", "pinned host<->GPU copy over PCIe 3.0 x16, one GPU alone",
        "mpicbg-scicomp/gearshifft#82: bandwidthTest pinned H2D 12.15, D2H 12.89 GB/s (P100 PCIe3 x16); "
        "ZaidQureshi/bam#54: 'V100 ingress bandwidth is 12GBps'"),
    "pcie4_host_measured": Figure(
        25.0, "GB/s per direction", "pinned host<->GPU copy over PCIe 4.0 x16 (A100)",
        "ZaidQureshi/bam#54: 'the peak x16 PCIe Gen4 is 25GBps' (measured)"),
    "pcie5_host_measured": Figure(
        35.0, "GB/s per direction", "host->GPU copy, H100 (the slower direction)",
        "NVIDIA/nvbandwidth#24: host_to_device_memcpy_sm 35.2 GB/s, device_to_host 52.8 GB/s (H100)"),
    "gpus_per_pcie_uplink_sxm2": Figure(
        2.0, "GPUs", "V100-SXM2 boards: two GPUs share each PCIe switch's x16 uplink to the CPU",
        "Leadtek WinFast GS4830NT (8xV100-SXM2, DGX-1 layout): 'each PCI-E PLX switch is the root of two SXM2 "
        "modules and one PCI-E 3.0 x16 slot'"),
    # --- optimizer -----------------------------------------------------------------------------------
    "gpu_optimizer_v100": Figure(
        2.0e9, "parameters/s per GPU", "DeepSpeed ZeRO-3 optimizer step on V100 (fused Adam + unscale, "
        "norm, fp16 copy), per partitioned parameter",
        "DeepSpeed ZeRO++ tutorial, ZeRO baseline log (docs/assets/images/zeropp/ZeRO-baseline.png): "
        "'optimizer: 277.16' then '139.50' ms for 18.1B parameters / 64 V100-SXM3 = 283M per GPU; ZeRO++ log: "
        "142.42 ms. A memory-bound Adam (~40 B/parameter at 900 GB/s) would take 13 ms: DeepSpeed's step costs "
        "10x that; other GPUs scaled by HBM bandwidth (gpu_hbm_*)"),
    "gpu_hbm_v100": Figure(900.0, "GB/s", "V100 HBM2", "NVIDIA V100 datasheet (zerotune NOTES hardware table)"),
    "gpu_hbm_t4": Figure(320.0, "GB/s", "T4 GDDR6", "NVIDIA T4 datasheet (zerotune NOTES hardware table)"),
    "gpu_hbm_a100": Figure(2039.0, "GB/s", "A100-SXM4-80GB HBM2e", "NVIDIA A100 datasheet"),
    "gpu_hbm_h100": Figure(3350.0, "GB/s", "H100-SXM5 HBM3", "NVIDIA H100 datasheet"),
    "cpu_adam": Figure(
        1.62e9, "parameters/s per node", "DeepSpeedCPUAdam (AVX512) on a 2-socket Xeon host",
        "DeepSpeed ZeRO-Offload tutorial log (docs/assets/images/zero_offload_dp1_10B_log.png): optimizer_step "
        "6478.57 and 6217.36 ms for its 10.28B GPT-2 (50 layers, hidden 4096, vocab 50,257, 1,024 positions) on "
        "one V100-SXM3 (DGX-2 host, 2x 24-core Xeon Platinum 8168), one process using the host's cores. Checked "
        "against DeepSpeed PR #735: 11.6B in 8.2 s (1.41e9/s, tests/test_time_model.py)"),
    # --- overlap ---------------------------------------------------------------------------------------
    "overlap": Figure(
        0.75, "share", "of the shorter of a pass's compute and communication that runs concurrently",
        "assumption, consistent with the ZeRO++ V100 measurements (tests/test_time_model.py ZEROPP): the "
        "rows imply 0.81-0.95 or more (1x 1K and 800G 2K are pessimistic even at 1.0), the 4x 1K row 0.24; "
        "0.5 and 1.0 are compared in docs/planner_time.md"),
    # --- fixed costs per optimizer step -------------------------------------------------------------
    "fetch_s_per_token": Figure(
        1.1e-6, "s per token", "the Trainer fetching and collating the step's GA micro-batches before the first "
        "forward (transformers 5 get_batch_samples; zerotune's dataloader_num_workers=0: not overlapped)",
        "measured here: 18.3 ms per 16,384-token packed row (datasets row access + train/args.py collate_packed) "
        "on this 2-core VM under CI load: an upper bound for a cluster node"),
    "bookkeeping_s": Figure(
        0.3, "s per step", "logging, zerotune's step metrics and their all-reduce of a few scalars, host syncs",
        "calibrated (issue 53): with the host term, the three H200 gpu-check rows (docs/planner_time.md) stay "
        "within +-35% for 0.11-0.42 s; 0.3 s balances them (+16%, -16%, +20%). The former 0.5 s upper bound "
        "(an assumption) puts the 2K row at +41%: it had carried the host work before that was modelled. "
        "NCCL small-message all-reduce ~25-35 us on 2 nodes (NVIDIA/nccl-tests#128 rows)"),
    # --- host work ------------------------------------------------------------------------------------
    "zero3_host_s_per_layer_pass": Figure(
        4.5e-3, "s per layer per pass", "DeepSpeed ZeRO-3's Python on the host for one decoder layer's "
        "modules in one pass (forward, recompute or backward): the pre/post hooks of every module, fetch and "
        "release with the trace, the gathers' and reduce-scatters' calls",
        "measured here (bench/bench_zero3_host.py, bench/results/zero3_host.md): HF Llama's module tree with "
        "gradient checkpointing under ZeRO-3 on one CPU rank minus the plain model, slope over 4-32 layers "
        "(0.50 ms per module with parameters; 6.7 ms in the run before; a sweep over plain Linear modules gave "
        "0.58-0.99 ms per module and pass in four runs: +-30%); a 2-core AMD EPYC VM: a cluster host's core runs the same Python, faster or slower by its single-thread "
        "speed (the H200 rows, docs/planner_time.md, do not contradict it)"),
    "zero3_host_s_per_lora_layer_pass": Figure(
        6.6e-3, "s per layer per pass", "the same under LoRA as adapters.py wraps it (every linear adapted, "
        "each one ZeRO-3 leaf: its wrapper's hooks gather base and adapters at its entry)",
        "measured here beside the figure above (bench/bench_zero3_host.py, r 16 on every linear)"),
    # --- the phases after the training steps ---------------------------------------------------------
    "storage_read": Figure(
        1.0e9, "B/s", "reading a checkpoint or the consolidated model back from shared storage, all ranks together",
        "assumption, the same figure as the write rate (compute.SAVE_BYTES_PER_S): measure your own file system"),
    "cpu_fp16_flops": Figure(
        5.0e10, "FLOP/s", "finalize's probe forward on the host CPU in the training dtype (fp16/bf16 matmuls on a "
        "CPU without native 16-bit arithmetic)",
        "assumption (order of magnitude): torch's CPU fp16 GEMM converts to fp32 tiles; a 36-core Xeon node's "
        "fp32 peak is ~2-3 TFLOPS, 16-bit conversions and the 256-token shape keep it well below"),
}


def F(name: str) -> float:
    return FIGURES[name].value


@dataclass(frozen=True)
class RingProtocol:
    """One NCCL protocol of the ring all-gather / reduce-scatter, as NCCL's tuner models it: latency base_us +
    (ranks - nodes) in-node steps + (nodes - 1) network steps, bandwidth bw_factor x the bus bandwidth."""
    base_us: float
    step_us: tuple       # one ring step over (NVLink, PCIe, the network)
    bw_factor: float     # of the bus bandwidth nccl-tests measures (FIGURES: the Simple protocol's)
    nvlink_only: bool    # LL128: on by default only where a node's GPUs talk over NVLink
    cap_gbs: tuple = ()  # LL: llMaxBw across 2 nodes, more (Intel hosts); one node: the GPU's (Cluster.ll_cap_gbs)
    net_overhead: float = 1.0  # across nodes an in-node step costs at least this x NCCL's network post overhead


# NCCL picks, per call, the protocol with the least latency + bytes / bandwidth (ncclTopoGetAlgoTime); ZeRO-3's
# gathers and reduce-scatters on V100-A100-H100 clusters get the ring (PAT needs one GPU per node, NVLS is off
# before Hopper and for all-gather across nodes, CollNet is off by default). Its tuner's constants, not a fit:
NCCL_RING = {
    "Simple": RingProtocol(8.4, (3.4, 5.7, 14.0), 1.0, False, net_overhead=3.0),
    "LL128": RingProtocol(14.0, (1.9, 2.5, 4.0), 0.92, True),
    "LL": RingProtocol(6.6, (0.6, 1.0, 2.7), 0.5, False, (39.0, 20.4)),
}
NCCL_NET_OVERHEAD_US = 1.0  # getNetOverhead on an Intel x86 host (2.0 on AMD)
NCCL_SOURCE = ("NVIDIA/nccl src/graph/tuning.cc (master 5067397c): ncclTunerConstantsDefaults baseLatencies and "
               "hwLatencies (Ring: LL, LL128, Simple; NVLINK, PCI, NET rows), ring AllGather/ReduceScatter latency "
               "base + (nsteps - nInterSteps) x intraLat + nInterSteps x interLat with nsteps = ranks - 1, "
               "nInterSteps = nodes - 1, across nodes intraLat at least the network overhead (x3 for Simple) "
               "(ncclTopoTuneModel); bandwidth LL x0.5 capped by llMaxBws, LL128 x0.92; "
               "LL128 enabled by default only over NVLink (typeIntra <= PATH_NVB). The network step of Simple is 14 us "
               "since NCCL 2.18 (9.6 before); IB verbs adds no plugin latency")


@dataclass(frozen=True)
class Cluster:
    """A cluster type: the links one job's traffic crosses. Bandwidths in GB/s, from FIGURES."""
    name: str
    describe: str
    intra: float  # NCCL busbw among the GPUs of one node
    nic: str      # FIGURES key of one network port's line rate
    nics: int     # network ports per node
    host: float   # host<->GPU per GPU when every GPU of the node copies at once
    hbm: float
    cpu_adam: float  # parameters/s per node
    intra_link: str = "nvlink"  # how a node's GPUs reach each other: "nvlink" or "pci" (NCCL's ring step latency)
    ll_cap_gbs: float = 39.0  # NCCL's LL bandwidth cap inside one node, by GPU generation (llMaxBws: Volta 39)

    @property
    def inter(self) -> float:
        """NCCL busbw across nodes, per node: a ring enters and leaves each node through its ports."""
        return self.nics * F(self.nic) * F("nccl_efficiency")


def _v100(nics: int, nic: str = "ib_edr_line") -> Cluster:
    port = {"ib_edr_line": "EDR 100 Gb/s", "ib_hdr_line": "HDR 200 Gb/s"}[nic]
    return Cluster(f"v100-sxm2-{nics}x{nic.split('_')[1]}",
                   f"8x V100-SXM2 NVLink2 hybrid cube-mesh per node, {nics}x InfiniBand {port} per node",
                   intra=F("nvlink2_v100_line") * F("nccl_efficiency"), nic=nic, nics=nics,
                   host=F("pcie3_host_measured") / F("gpus_per_pcie_uplink_sxm2"), hbm=F("gpu_hbm_v100"),
                   cpu_adam=F("cpu_adam"))


CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    _v100(1), _v100(4), _v100(1, "ib_hdr_line"),
    Cluster("t4-pcie-1xedr", "T4s on PCIe 3.0 (no NVLink), 1x InfiniBand EDR per node",
            intra=F("pcie3_x16_line") * F("nccl_efficiency"), nic="ib_edr_line", nics=1,
            host=F("pcie3_host_measured"), hbm=F("gpu_hbm_t4"), cpu_adam=F("cpu_adam"), intra_link="pci"),
    Cluster("a100-sxm4-8xhdr", "8x A100-SXM4 NVLink3 per node, 8x InfiniBand HDR per node (DGX A100)",
            intra=F("nvlink3_a100_busbw"), nic="ib_hdr_line", nics=8, host=F("pcie4_host_measured"),
            hbm=F("gpu_hbm_a100"), cpu_adam=F("cpu_adam"), ll_cap_gbs=87.7),  # llMaxBws Ampere-N1
    Cluster("h100-sxm5-8xndr", "8x H100-SXM5 NVLink4 per node, 8x InfiniBand NDR per node (DGX H100)",
            intra=F("nvlink4_h100_busbw"), nic="ib_ndr_line", nics=8, host=F("pcie5_host_measured"),
            hbm=F("gpu_hbm_h100"), cpu_adam=F("cpu_adam"), ll_cap_gbs=141.0),  # llMaxBws Hopper-N1
)}
# What a V100 plan shows beside its own cluster type in the node table.
ALTERNATIVES = {"v100-sxm2-1xedr": ("v100-sxm2-4xedr",), "v100-sxm2-4xedr": ("v100-sxm2-1xedr",)}


def gpu_optimizer_rate(c: Cluster) -> float:
    """Parameters/s per GPU for DeepSpeed's optimizer step: the V100 measurement scaled by HBM bandwidth."""
    return F("gpu_optimizer_v100") * c.hbm / F("gpu_hbm_v100")


@dataclass(frozen=True)
class Job:
    """One optimizer step of one recipe on one cluster shape, as the time model needs it."""
    n_params: int            # every parameter: ZeRO-3 gathers them all (frozen ones too)
    trainable: int           # parameters with gradients: reduce-scattered, optimized, checkpointed
    flops_micro: float       # FLOPs one GPU executes per micro-step (forward, recompute, backward)
    forward_share: float     # of flops_micro in the forward pass: 1/4 with recompute, 1/3 without
    tokens_micro: int        # tokens per GPU per micro-step (seq_len x micro-batch)
    grad_accum: int
    gpus_per_node: int
    nodes: int
    dtype_bytes: int         # model dtype: what ZeRO-3 gathers (2 for fp16/bf16)
    zero_stage: int          # 3; 2: gradients reduce-scattered every micro-step; 0-1 (or DDP): one all-reduce per step
    offload_optimizer: bool = False
    hpz: int = 1             # zero_hpz_partition_size
    save_s: float = 0.0      # one checkpoint save
    save_steps: int = 0
    # ZeRO-3, module by module: the numel each gathered module's gather moves (its parameters above
    # stage3_param_persistence_threshold), in gather order; () = the model as one collective, no latency (by hand)
    module_numels: tuple = ()
    reduce_bucket: int = 0   # reduce_bucket_size (numel): how many reduce-scatters adapters' few gradients take
    # sequence parallelism (DeepSpeed Ulysses): ranks per row, and what one rank exchanges per layer and pass
    sequence_parallel: int = 1
    ulysses_bytes: float = 0.0  # q, k, v in and the attention output back, this rank's slice of the row
    layers: int = 0
    passes: int = 3             # forward, recompute (gradient checkpointing), backward; 2 without recompute
    adapters: bool = False      # LoRA / QLoRA: ZeRO-3's host work per layer is the adapted layer's
    rollout_s: float = 0.0      # GRPO: the step's generate() calls on each rank, before their micro-steps' forwards
    # ZeRO-3 prefetches the next modules' gathers along the trace it recorded. GRPO's rollouts before every micro-step
    # take it away (measured: tests/test_zero3_trace.py). Through the hooks (per-token gathers) generate() leaves its
    # forward's trace: the training forward follows it, the backward runs past its end and invalidates it ("forward").
    # Gathered once, unwrap_model_for_generation re-registers the hooks, which invalidates it (deepspeed 0.19.8
    # parameter_offload.py:337-343): the micro-step records it again and prefetches nothing ("none").
    prefetch: str = "all"

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


def collective_s(nbytes: float, ranks: int, c: Cluster, across_nodes: bool) -> float:
    """A ring all-gather / reduce-scatter of nbytes (the full gathered size) over `ranks` ranks."""
    if ranks <= 1:
        return 0.0
    bw = min(c.intra, c.inter) if across_nodes else c.intra
    return nbytes * (ranks - 1) / ranks / (bw * GB)


def ring_collective_s(nbytes: float, ranks: int, nodes: int, c: Cluster) -> tuple[float, float]:
    """(seconds, of which latency) of one ring all-gather / reduce-scatter of nbytes (the full gathered size) as
    NCCL's tuner times it, with the protocol it would pick: the least latency + bytes / bandwidth of NCCL_RING."""
    if ranks <= 1:
        return 0.0, 0.0
    share = nbytes * (ranks - 1) / ranks
    bw = (min(c.intra, c.inter) if nodes > 1 else c.intra) * GB
    hw = {"nvlink": 0, "pci": 1}[c.intra_link]
    best = None
    for p in NCCL_RING.values():
        if p.nvlink_only and c.intra_link != "nvlink":
            continue
        b = bw * p.bw_factor
        if p.cap_gbs:
            b = min(b, (c.ll_cap_gbs if nodes == 1 else p.cap_gbs[min(nodes, 3) - 2]) * GB)
        step = p.step_us[hw] if nodes == 1 else max(p.step_us[hw], p.net_overhead * NCCL_NET_OVERHEAD_US)
        lat = (p.base_us + (ranks - nodes) * step + (nodes - 1) * p.step_us[2]) * 1e-6
        if best is None or lat + share / b < sum(best):
            best = (share / b, lat)
    return best[0] + best[1], best[1]


def zero3_gather_s(dtype_bytes: int, n_params: int, module_numels: tuple, ranks: int, nodes: int,
                   c: Cluster) -> tuple[float, float, int]:
    """(seconds, of which latency, collectives) of gathering the model once, module by module: DeepSpeed's
    fetch_sub_module gathers a module's own parameters (its prefetch may take a few small neighbours in one
    collective: partitioned_param_coordinator.py), counted as one collective per gathered module. No modules
    given: the model's bytes as one collective, no latency (the hand-computed cases)."""
    if not module_numels:
        return collective_s(dtype_bytes * n_params, ranks, c, nodes > 1), 0.0, 0
    return _ring_collectives_s([dtype_bytes * n for n in module_numels], ranks, nodes, c)


def zero3_reduce_scatter_s(job: Job, ranks: int, nodes: int, c: Cluster) -> tuple[float, float, int]:
    """(seconds, of which latency, collectives) of one micro-step's gradient reduce-scatters. stage3.py fills a
    bucket of reduce_bucket_size and flushes it before a gradient that would overflow it: a full fine-tune's
    modules each about one flush (Llama: a norm beside a projection of hidden^2 goes alone, 8 per layer for 7
    projections); adapters' gradients fill whole buckets."""
    grads = job.dtype_bytes * job.trainable  # communication_data_type = the model's 16-bit dtype
    if not job.module_numels:
        return collective_s(grads, ranks, c, nodes > 1), 0.0, 0
    # (a full fine-tune is charged one per module: with a reduce_bucket_size far above hidden^2 DeepSpeed sends
    # fewer, larger ones, and the model errs slow)
    if job.trainable < sum(job.module_numels) and job.reduce_bucket:
        k = -(-job.trainable // job.reduce_bucket)
        sizes = [grads / k] * k
    else:
        sizes = [job.dtype_bytes * n for n in job.module_numels]
    return _ring_collectives_s(sizes, ranks, nodes, c)


def _ring_collectives_s(sizes: list, ranks: int, nodes: int, c: Cluster) -> tuple[float, float, int]:
    """(seconds, of which latency, how many) of one ring collective per size in bytes."""
    t = [ring_collective_s(b, ranks, nodes, c) for b in sizes]
    return sum(x for x, _ in t), sum(lat for _, lat in t), len(t)


def _pass_s(compute: float, comm: float, overlap: float) -> float:
    return max(compute, comm) + (1 - overlap) * min(compute, comm)


def zero3_host_pass_s(zero_stage: int, layers: int, adapters: bool = False) -> float:
    """DeepSpeed's host work for one pass over the model under ZeRO-3 (at any world size: one rank gathers nothing,
    its hooks still run). It runs ahead of the GPU's queue, so a pass takes the longer of it and the GPU's work."""
    if zero_stage != 3:
        return 0.0
    return layers * F("zero3_host_s_per_lora_layer_pass" if adapters else "zero3_host_s_per_layer_pass")


def step_time(job: Job, c: Cluster, peak_tflops: float, mfu: float, overlap: float | None = None) -> dict:
    """Seconds per optimizer step by term, and what each term is made of (per micro-step, per GPU)."""
    overlap = F("overlap") if overlap is None else overlap
    w, ga, gpn = job.world, job.grad_accum, job.gpus_per_node
    multi = job.nodes > 1
    compute = job.flops_micro / (peak_tflops * 1e12 * mfu)
    c_fwd, c_bwd = compute * job.forward_share, compute * (1 - job.forward_share)
    grads = job.dtype_bytes * job.trainable  # communication_data_type = the model's 16-bit dtype
    per_gpu = job.trainable / w
    detail = {}
    step_comm = 0.0  # traffic outside the micro-steps (non-ZeRO-3 all-reduce)
    if job.zero_stage == 3 and w > 1:
        model = (job.dtype_bytes, job.n_params, job.module_numels)
        world_gather, world_lat, n_gather = zero3_gather_s(*model, w, job.nodes, c)
        if job.hpz > 1:
            h = min(job.hpz, w)
            local_gather, local_lat, _ = zero3_gather_s(*model, h, -(-h // gpn), c)
            fwd_gather = (world_gather + (ga - 1) * local_gather) / ga  # only the step's first crosses the world
            bwd_gather = local_gather
            fwd_lat, bwd_lat = (world_lat + (ga - 1) * local_lat) / ga, local_lat
        else:
            fwd_gather = bwd_gather = world_gather
            fwd_lat = bwd_lat = world_lat
        reduce_scatter, rs_lat, n_rs = zero3_reduce_scatter_s(job, w, job.nodes, c)
        detail.update(forward_gather_s=fwd_gather, backward_gather_s=bwd_gather, reduce_scatter_s=reduce_scatter)
        if n_gather:
            detail.update(latency_s=fwd_lat + bwd_lat + rs_lat, collectives=2 * n_gather + n_rs)
    elif job.zero_stage == 2 and w > 1:
        # partition_gradients: the gradients are reduced on every micro-step's backward, not at the boundary
        # (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py:2293-2295); the parameters are not partitioned
        fwd_gather = bwd_gather = 0.0
        reduce_scatter = collective_s(grads, w, c, multi)
        detail["reduce_scatter_s"] = reduce_scatter
    else:
        fwd_gather = bwd_gather = reduce_scatter = 0.0
        if w > 1:  # DDP / ZeRO-1 under GA (no_sync): one all-reduce of the gradients at the step boundary
            step_comm = 2 * collective_s(grads, w, c, multi)  # per step, not per micro-step: kept out of detail
    pcie = 0.0
    if job.offload_optimizer:
        pcie = 8 * per_gpu / (c.host * GB)  # fp32 partition host -> GPU, add, GPU -> host (first micro-step too)
        detail["offload_grad_pcie_s"] = pcie
    m_fwd, m_bwd = fwd_gather, bwd_gather + reduce_scatter + pcie
    # Ulysses: four all-to-alls per layer per pass inside the node (a row's ranks never span nodes: config.py), on
    # the critical path (each layer's attention waits for its q, k, v; the next layer for the output), so not
    # overlapped; an all-to-all moves (N-1)/N of each rank's data over its links, as a ring collective does
    a2a = 0.0
    if job.sequence_parallel > 1:
        a2a = job.passes * job.layers * collective_s(job.ulysses_bytes, job.sequence_parallel, c, False)
        detail["sequence_parallel_s"] = a2a
    # without prefetch a pass's gathers wait in line; the reduce-scatter keeps its own stream (overlap_comm)
    gpu_fwd = _pass_s(c_fwd, m_fwd, overlap) if job.prefetch != "none" else c_fwd + m_fwd
    gpu_bwd = (_pass_s(c_bwd, m_bwd, overlap) if job.prefetch == "all" else
               _pass_s(c_bwd, m_bwd - bwd_gather, overlap) + bwd_gather)
    host = zero3_host_pass_s(job.zero_stage, job.layers, job.adapters)
    host_fwd, host_bwd = host, (job.passes - 1) * host  # recompute and backward: the backward pass's two
    micro = gpu_fwd + gpu_bwd + a2a
    host_exposed = max(host_fwd - gpu_fwd, 0.0) + max(host_bwd - gpu_bwd, 0.0)
    if host:
        detail.update(host_s=host_fwd + host_bwd, host_exposed_s=host_exposed)
    if job.offload_optimizer:
        optimizer = job.trainable / job.nodes / c.cpu_adam + 2 * per_gpu / (c.host * GB)
        opt_how = (f"CPU Adam {job.trainable / job.nodes:.3g} parameters per node at {c.cpu_adam:.3g}/s + fp16 "
                   f"parameters back over PCIe ({c.host:g} GB/s per GPU)")
    else:
        optimizer = per_gpu / gpu_optimizer_rate(c)
        opt_how = f"{per_gpu:.3g} parameters per GPU at {gpu_optimizer_rate(c):.3g}/s"
    fetch = ga * job.tokens_micro * F("fetch_s_per_token")
    save = job.save_s / job.save_steps if job.save_steps > 0 else 0.0
    fixed = fetch + F("bookkeeping_s") + save
    terms = {"compute": ga * compute, "communication": ga * (micro - compute) + step_comm,
             "host": ga * host_exposed, "optimizer": optimizer, "fixed": fixed, "rollout": job.rollout_s}
    total = sum(terms.values())
    comm_micro = m_fwd + m_bwd + a2a  # all of it, before overlap
    return {
        "terms": terms, "seconds_per_step": total, "dominant": max(terms, key=terms.get),
        "shares": {k: v / total for k, v in terms.items()},
        "per_micro_step": {"compute_s": compute, "communication_s": comm_micro, "exposed_s": micro - compute,
                           **detail},
        "step_communication_s": step_comm,
        "communication_over_compute": comm_micro / compute if compute else math.inf,
        # tokens per GPU per micro-step below which the traffic takes longer than the compute (traffic per
        # micro-step does not depend on the tokens; compute is about proportional to them)
        "crossover_tokens": job.tokens_micro * comm_micro / compute if compute else None,
        "optimizer_how": opt_how,
        "fixed_parts": {"fetch_s": fetch, "bookkeeping_s": F("bookkeeping_s"), "save_s": save},
        "overlap": overlap, "prefetch": job.prefetch, "cluster": c.name, "inter_node_gbs": c.inter, "intra_node_gbs": c.intra,
    }


def hpz_bytes(n_params: int, dtype_bytes: int, hpz: int) -> int:
    """GPU bytes of hpZ's secondary parameter copy (partition_parameters.py _partition_param_sec)."""
    return 0 if hpz <= 1 else int(math.ceil(n_params / hpz) * dtype_bytes)


@dataclass(frozen=True)
class Model:
    """The forwards a no-grad phase runs (validation, samples, GRPO's rollouts) on one cluster: what they cost."""
    n_params: int
    layers: int
    q_dim: int
    dtype_bytes: int
    world: int
    nodes: int
    c: Cluster
    peak_tflops: float
    mfu: float
    module_numels: tuple = ()
    host_pass_s: float = 0.0

    @property
    def gather_s(self) -> float:
        return zero3_gather_s(self.dtype_bytes, self.n_params, self.module_numels, self.world, self.nodes, self.c)[0]

    def flops(self, tokens: float, span: float) -> float:
        return tokens * (2 * self.n_params + 2 * 2 * span * self.q_dim * self.layers)

    def forward_s(self, tokens: int, span: float) -> float:
        compute = self.flops(tokens, span) / (self.peak_tflops * 1e12 * self.mfu)
        return max(_pass_s(compute, self.gather_s, F("overlap")), self.host_pass_s)

    def generation(self, n: int, prompt: int, new: int, once_gathered: bool) -> tuple[float, float, float]:
        """(the gather before it, the prefill, one decode step) of a generate() over n rows."""
        span = prompt + new / 2
        if once_gathered:
            flops_s = self.peak_tflops * 1e12 * self.mfu
            local = self.dtype_bytes * self.n_params / (self.c.hbm * GB)  # every weight read once per decode step
            step = max(local, self.flops(n, span) / flops_s)
            return self.gather_s, self.flops(n * prompt, prompt / 2) / flops_s, step
        # decode: gather-bound, the compute is ~0
        return 0.0, self.forward_s(n * prompt, prompt / 2), self.forward_s(n, span)


def rollout_time(model: Model, rows: int, prompt: int, new: int, micro_steps: int, gather_once: bool,
                 reference: str | None = None) -> dict:
    """GRPO: before each micro-step's forward, one generate() of its `rows` rows (micro prompts x G), timed as the
    samples' generation with `rows` rows per forward (a decode step reads the weights once for all of them);
    seconds per optimizer step (`micro_steps` of them), per rank (ranks roll out at once). Sampling costs what
    greedy does; every row runs the whole budget (the bound: a finished row's pads still go through the batch's
    forwards). reference: the KL's pass over the rows: "copy", the starting model's local copy (compute only, no
    gathers); "adapters_off", LoRA's policy itself (a forward as validation's: ZeRO-3 gathers it)."""
    once, prefill, token = model.generation(rows, prompt, new, gather_once)
    tokens, span = rows * (prompt + new), (prompt + new) / 2
    ref = 0.0
    if reference == "copy":
        ref = model.flops(tokens, span) / (model.peak_tflops * 1e12 * model.mfu)
    elif reference == "adapters_off":
        ref = model.forward_s(tokens, span)
    micro = once + prefill + new * token + ref
    return {"seconds": micro_steps * micro, "per_micro_step_s": micro, "per_token_s": token, "rows": rows,
            "new_tokens": new, "reference_s": ref, "gather_once": gather_once}


def phase_times(model: Model, *, seq: int, attention_span: float, eval_rows: int | None,
                samples: int, prompt_tokens: int, new_tokens: int, checkpoint_bytes: int, model_bytes: int,
                save_s: float, gather_once: bool = False, probe_tokens: int = 256, rows_per_forward: int = 1,
                reference_rows: int | None = None) -> dict:
    """Seconds of each phase that is not a training step, once each (the plan prints them beside their memory;
    the deadline reserves the end of training's validation and samples).
    validation: every rank forwards ceil(eval rows / world) rows of `seq` tokens, no grad: 2N + attention FLOPs
      per token, and ZeRO-3 gathers every parameter for each forward (the training forward's all-gather).
    samples: greedy generation under ZeRO-3: a prefill of the prompt, then one forward per new token, and each of
      those gathers every parameter again (deepspeed 0.19.8 partitioned_param_coordinator.py ~494-499, 634-660:
      stage3_max_reuse_distance 1e9 < the parameters gathered per token, so nothing stays): at 8B, 16 GB per token
      and one collective's latency per module (module_numels).
      gather_once: the whole model is gathered once for the round (train/validation.py, where the plan finds the memory
      for it), then each token reads the local weights from HBM: decode is memory-bound.
    save: the checkpoint write (compute.SAVE_BYTES_PER_S). resume: reading it back (storage_read).
    finalize: rank 0 reads the consolidated model back and runs the verification probe on the CPU.
    DPO: validation and the reference pass forward `rows_per_forward` rows (a micro-batch's pairs) per call, one
    gather per call; reference: `reference_rows` rows (2 per train and validation pair; None: data not prepared).
    host_pass_s: ZeRO-3's host work per forward (zero3_host_pass_s), the least a forward takes, decode's tokens
    included; under gather_once the hooks find every weight present (not measured: not charged)."""
    world = model.world
    per_row = model.forward_s(seq * rows_per_forward, attention_span) / rows_per_forward
    calls = -(-eval_rows // (world * rows_per_forward)) if eval_rows else None
    rows = calls * rows_per_forward if calls else None
    once, prefill, token = model.generation(1, prompt_tokens, new_tokens, gather_once)
    out = {}
    if rows_per_forward > 1:  # DPO
        ref_calls = -(-reference_rows // (world * rows_per_forward)) if reference_rows else None
        out["reference"] = {"seconds": per_row * rows_per_forward * ref_calls if ref_calls else None,
                            "per_row_s": per_row, "rows_per_rank": ref_calls and ref_calls * rows_per_forward}
    return {
        **out,
        "validation": {"seconds": per_row * rows if rows else None, "per_row_s": per_row, "rows_per_rank": rows},
        "samples": {"seconds": once + samples * (prefill + new_tokens * token) if samples else 0.0,
                    "per_token_s": token, "prompts": samples, "new_tokens": new_tokens},
        "save": {"seconds": save_s},
        "resume": {"seconds": checkpoint_bytes / F("storage_read")},
        "finalize": {"seconds": model_bytes / F("storage_read") + probe_tokens * 2 * model.n_params
                     / F("cpu_fp16_flops")},
    }
