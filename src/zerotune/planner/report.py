"""The plan as a person reads it: `zerotune plan`'s text, `finetune --dry-run`, and the memory chart."""

from __future__ import annotations

from .. import ds_config
from ..config import Recipe
from .disk import CONVERT_BYTES_PER_S
from .memory import GiB
from .options import RECOMMEND_GAIN
from .records import (FewSteps, FinalizeHostRam, HpzCopy, NodeTable, OffloadHostRam, OffloadTime, OffloadUnmodelled,
                      Phase, Plan, PlanWarning, Suggestion)


def _gib(b) -> str:
    return f"{b / GiB:6.2f} GiB"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:,.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


# why a GRPO micro-step's gathers are not prefetched (time.Job.prefetch, measured in tests/test_zero3_trace.py)
_PREFETCH = {"all": "",
             "forward": "; the backward's gathers not prefetched: the rollouts' generate() leaves ZeRO-3 a forward's "
                        "trace, which the backward runs past",
             "none": "; no gather prefetched: the rollouts' gather once re-registers ZeRO-3's hooks, so every "
                     "micro-step records its trace again"}


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:,.1f} s"


def _phase_time(name: str, ph: Phase) -> str:
    """The phase's seconds once (planner/time.py phase_times); the training step's are in the time section."""
    t = ph.time
    if name == "train_step":
        return "below"
    if not t or not ph.runs:
        return "-"
    if t.seconds is None:  # validation before `make data`: the eval rows are not counted yet
        return f"{t.per_row_s:.1f} s/row"
    return _duration(t.seconds) + ("/step" if name == "rollout" else "")


def _phase_time_notes(p: Plan) -> list[str]:
    return _rollout_note(p) + _samples_note(p)


def _rollout_why(p: Plan) -> str:
    """GRPO's rollout term of the step (time section): the micro-steps' generate() calls, and how they gather."""
    ph = p.phases.rollout
    if ph is None or ph.time is None:
        return ""
    t = ph.time
    how = ("the whole model gathered once per generate()" if ph.gather_once else
           "per-token gathers under ZeRO-3: the whole model does not fit beside the rollout's peak")
    return (f"{p.time.grad_accum} generate() x {_duration(t.per_micro_step_s)}: {t.rows} completions x "
            f"{t.new_tokens} sampled tokens each, {t.per_token_s:.3f} s per decode step ({how})"
            + (f", then the starting model's forward of them ({_duration(t.reference_s)}, the KL's)"
               if t.reference_s else ""))


def _rollout_note(p: Plan) -> list[str]:
    """GRPO: what each optimizer step spends generating, beside what it spends training."""
    ph = p.phases.rollout
    if ph is None or ph.time is None or not p.time.seconds_per_step:
        return []
    t, step = ph.time, p.time.seconds_per_step
    return [f"  rollout: {_duration(t.seconds)} of each {_duration(step)} optimizer step ({t.seconds / step:.0%}) "
            f"samples completions, the rest trains on them: {_rollout_why(p)}"]


def _samples_note(p: Plan) -> list[str]:
    samples = p.phases.samples
    s = samples.time
    if not (p.phases.validation.time and s and samples.runs and s.seconds):
        return []
    how = ("the whole model is gathered once per round (it fits beside the phase's peak), then each token reads "
           "local weights" if samples.gather_once else
           "the whole model does not fit beside the phase's peak, so under ZeRO-3 every new token gathers every "
           "parameter again")
    return [f"  samples: {s.prompts} prompts x up to {s.new_tokens} new tokens; {how}: "
            f"{s.per_token_s:.2f} s per token on this cluster"]


def format_replay(p: Plan) -> list[str]:
    """data.replay's answering in the data step: its peak on one device against that device, and its time."""
    if p.replay_error:
        return [f"\nreplay (data step): not planned: {p.replay_error}"]
    rp = p.replay
    if rp is None:
        return []
    ph, t = rp.run.phase, rp.run.time
    where = "one GPU" if ph.limit == "gpu" else "CPU, host RAM"
    lines = [f"\nreplay (data step, before training, {where}): the base model answers {rp.prompts:,} prompts of "
             f"{rp.path}, {rp.batch_size} per generate() call, prompt <= {rp.prompt_tokens:,} tokens "
             f"({rp.prompt_tokens_from}) + up to {rp.max_new_tokens} new, {rp.precision} on {rp.device}",
             f"  peak {_gib(ph.peak_bytes).strip()} of {_gib(ph.capacity_bytes).strip()}: "
             f"{'fits' if ph.fits else 'DOES NOT FIT'} ("
             + ", ".join(f"{k} {v / GiB:.2f}" for k, v in ph.parts.items() if v >= GiB / 200)
             + " GiB, and terms below 0.005 GiB)"]
    if t is not None:
        bound = (f"memory-bound: every step reads all weights, at an assumed {t.efficiency:.0%} of the bandwidth"
                 if t.memory_bound else f"compute-bound at {t.mfu:.0%} MFU")
        lines.append(f"  time ~{_h(t.seconds)}: {rp.run.batches:,} batch(es) x {rp.max_new_tokens} decode steps of "
                     f"{t.seconds_per_step * 1e3:.0f} ms ({bound}) + prefill {_h(t.prefill_s)}; "
                     f"<= {rp.run.generated_tokens_max:,} tokens generated")
    else:
        lines.append(f"  time: no estimate on this target; <= {rp.run.generated_tokens_max:,} tokens generated")
    if not ph.fits:
        fix = (f"eval.batch_size={rp.largest_batch_that_fits} fits" if rp.largest_batch_that_fits
               else "not even eval.batch_size=1 fits: a smaller model or a larger GPU")
        lines.append(f"  fix: lower eval.batch_size ({fix}), or data.replay.max_new_tokens, or shorten / drop the "
                     "longest prompts (data.replay.limit takes the first N)")
    return lines


def node_advice(nt: NodeTable, gpus_per_node: int, capacity: int, tokens: int) -> list[str]:
    """What the node table says: the scaling and what it loses, where communication overtakes compute, and whether
    ZeRO++ hpZ pays at 4 nodes."""
    own = nt.cluster
    multi = [row for row in nt.rows if row.nodes > 1]
    if not multi:
        return []
    one, two = nt.rows[0].on(own), multi[0].on(own)
    scale = ", ".join(f"{row.nodes} nodes {row.on(own).speedup:.2f}x" for row in multi)
    lost = ", ".join(f"{row.on(own).terms.communication / row.on(own).seconds_per_step:.1%}" for row in multi)
    out = [f"scaling on {own}: {scale} one node; communication not hidden: {lost} of the step; the checkpoint "
           f"save ({one.fixed_parts.save_s:,.0f} s/step) does not shrink with more nodes",
           *(["GRPO's rollouts per step: " + ", ".join(f"{row.nodes} node{'s' if row.nodes > 1 else ''} "
                                                          f"{_duration(row.on(own).terms.rollout)}" for row in nt.rows)
              + ": fewer micro-steps each, and once the model states leave room the whole model is gathered once per "
                "generate() instead of every parameter per sampled token (`zerotune plan plan.nodes=N` says which)"]
             if one.terms.rollout else []),
           f"communication overtakes compute below ~{two.crossover_tokens:,.0f} tokens per GPU per micro-step "
           f"across nodes (~{one.crossover_tokens:,.0f} inside one node); the recipe runs {tokens:,} "
           "(seq_len x micro-batch)"]
    four = next((row for row in nt.rows if row.nodes == 4), multi[-1])
    e = four.on(own)
    if e.hpz_seconds_per_step is not None:
        saved = e.seconds_per_step - e.hpz_seconds_per_step
        share = saved / e.seconds_per_step
        mem = four.peak_bytes + four.hpz_extra_bytes
        fits = mem <= capacity
        worth = fits and share >= nt.hpz_worth
        out.append(f"ZeRO++ hpZ at {four.nodes} nodes (train.zero.zero_hpz_partition_size={gpus_per_node}): all "
                   f"gathers but the step's first stay in the node; saves {saved:,.0f} s/step ({share:.1%}) for "
                   f"+{four.hpz_extra_bytes / GiB:.2f} GiB per GPU (peak {mem / GiB:.2f} of "
                   f"{capacity / GiB:.2f} GiB: {'fits' if fits else 'DOES NOT FIT'}): "
                   + ("use it" if worth else f"not worth it below {nt.hpz_worth:.0%}")
                   + " (convergence reports: DeepSpeed #4851, #7606; compare first losses with and without)")
    return out


def format_time(p: Plan) -> list[str]:
    """The time section: FLOPs, the four terms with what dominates, and the node table with its advice."""
    t, c, rb = p.time, p.cluster, p.recipe_batch
    lines = [f"\ntime: {t.flops_per_step:.3g} FLOPs per optimizer step (6NT {t.flops_dense:.3g}, "
             f"recompute {t.flops_recompute:.3g}, attention {t.flops_attention:.3g} {t.attention_kind})"]
    if t.row_tokens_from:
        lines.append(f"  pairs: each row {t.tokens_per_step / rb.global_batch_tokens * rb.seq_len:,.0f} tokens as "
                     f"padded ({t.row_tokens_from}): {t.tokens_per_step:,.0f} tokens per step")
    if t.attention_span:
        lines.append(f"  attention per document ({p.choice.attention}): each token attends over "
                     f"{t.attention_span:,.0f} tokens on average ({t.attention_span_from}), not the whole "
                     f"{rb.seq_len:,}-token row")
    if not t.seconds_per_step:
        return lines + ["  no time estimate for this target (no peak TFLOPS)"]
    pm, fp = t.per_micro_step, t.fixed_parts
    total = t.seconds_per_step
    lines.append(f"  per optimizer step on {c.nodes} x {c.gpus_per_node} {c.gpu_name}, "
                 f"cluster {t.cluster}: in-node {t.intra_node_gbs:.0f} GB/s, between nodes {t.inter_node_gbs:.0f} GB/s "
                 "per node (planner/time.py)")
    gathers = ", ".join(f"{k} {v:.2f}" for k, v in pm.traffic())
    if pm.collectives:
        gathers += f"; of it NCCL latency {pm.latency_s:.2f} ({pm.collectives:,} collectives)"
    why = {"compute": f"{t.grad_accum} micro-steps x {pm.compute_s:.2f} s at {t.mfu:.0%} MFU (kernels only)",
           "communication": f"per micro-step {pm.communication_s:.2f} s of traffic ({gathers or 'none'}), "
                            f"{pm.exposed_s:.2f} s not hidden ({t.overlap:.0%} of the overlappable overlaps"
                            + _PREFETCH[t.prefetch] + ")"
                            + (f"; + {t.step_communication_s:.1f} s gradient all-reduce per step"
                               if t.step_communication_s else ""),
           "host": (f"per micro-step {pm.host_s:.2f} s of DeepSpeed's Python on the host (its hooks on every "
                    f"layer, every pass), {pm.host_exposed_s:.2f} s beyond the GPU's work; "
                    f"{_h(t.grad_accum * pm.host_s)} more per step if none of it overlapped"
                    if pm.host_s else "none (not ZeRO-3)"),
           "optimizer": t.optimizer_how,
           "fixed": f"batch fetch {fp.fetch_s:.1f} s, logging {fp.bookkeeping_s:.2f} s, checkpoint save "
                    f"{fp.save_s:.0f} s per step",
           "rollout": _rollout_why(p)}
    for k, v in t.terms.items():
        lines.append(f"  {k:<14} {_h(v):>10} {v / total:6.1%}  {why[k]}")
    lines.append(f"  {'total':<14} {_h(total):>10}         = "
                 f"{total / t.tokens_per_step * 1e6:.1f} us per token; dominated by {t.dominant}")
    nt = t.nodes
    if not nt:
        return lines
    lines.append(f"\nnodes (same {rb.global_batch_tokens:,}-token step, GA from the world size; "
                 f"comm = communication not hidden, share of the step; +hpZ = with zero_hpz_partition_size "
                 f"{c.gpus_per_node}):")
    head = f"  {'nodes':>5} {'GA':>5} {'peak GiB':>8}"
    for name in nt.clusters:
        label = name.rsplit("-", 1)[-1]
        head += f" | {label + ' h/step':>12} {'us/tok':>6} {'speedup':>7} {'comm':>5} {'+hpZ h':>6}"
    lines.append(head)
    for row in nt.rows:
        line = f"  {row.nodes:>5} {row.grad_accum:>5} {row.peak_bytes / GiB:>8.2f}"
        for name in nt.clusters:
            e = row.on(name)
            hp = f"{e.hpz_seconds_per_step / 3600:6.2f}" if e.hpz_seconds_per_step is not None else f"{'-':>6}"
            us = e.seconds_per_step / t.tokens_per_step * 1e6
            line += (f" | {e.seconds_per_step / 3600:>12.2f} {us:>6.1f}"
                     f" {e.speedup:>6.2f}x {e.terms.communication / e.seconds_per_step:>5.1%} {hp}")
        lines.append(line)
    lines += [f"  {a}" for a in node_advice(nt, c.gpus_per_node, c.capacity_bytes,
                                            rb.seq_len * rb.micro_batch_size * rb.rows_per_sample)]
    return lines


def suggestion(s: Suggestion) -> str:
    what = s.override or f"twice the GPUs ({s.gpus})"
    verdict = "fits" if s.fits else "still too big"
    return f"{what}: {s.peak_bytes / GiB:.1f} GiB ({verdict}{'; several times slower' if s.slower else ''})"


def warning(w: PlanWarning) -> str:
    """A warning's words, from its numbers (compute.warnings)."""
    if isinstance(w, FewSteps):
        return (f"only {w.total_steps} optimizer steps in this run ({w.train_sequences:,} sequences / "
                f"{w.sequences_per_step:,} per step x {w.epochs:g} epochs): fewer than {w.min_steps} steps make "
                "warmup and cosine decay meaningless; lower train.global_batch_tokens or add data.")
    if isinstance(w, OffloadTime):
        return (f"optimizer offload (modelled, planner/time.py): CPU Adam + fp16 copy-back {w.optimizer_s:,.0f} s "
                f"per step; the fp32 gradient partition crosses PCIe twice every micro-step, {w.pcie_s:.2f} s against "
                f"{w.compute_s:.1f} s of compute at {w.tokens_micro:,} tokens per micro-step (hidden behind backward "
                f"at this size). The step is slow because it has {w.world} GPUs; below ~"
                f"{w.tokens_micro * w.pcie_s / w.compute_s:,.0f} tokens per micro-step the PCIe traffic alone "
                "outlasts the compute.")
    if isinstance(w, OffloadUnmodelled):
        return "optimizer offload: CPU Adam and the PCIe traffic are not modelled on this target."
    if isinstance(w, OffloadHostRam):
        return (f"CPU RAM: DeepSpeed estimates {w.need_bytes / 1e9:.0f} GB per node for offloaded states, "
                f"plan.cpu_ram_gb is {w.cpu_ram_gb:g}.")
    if isinstance(w, HpzCopy):
        return (f"ZeRO++ hpZ (zero_hpz_partition_size={w.hpz}): its secondary parameter copy, "
                f"+{w.extra_bytes / GiB:.2f} GiB per GPU, is not in the memory breakdown above (peak with it "
                f"{w.peak_bytes / GiB:.2f} of {w.capacity_bytes / GiB:.2f} GiB). Compare the first losses with and "
                "without it before a long run (DeepSpeed #4851, #7606).")
    if isinstance(w, FinalizeHostRam):
        return (f"CPU RAM: finalize (verify{' + merge' if w.merge else ''} after training) needs "
                f"{w.peak_bytes / 1e9:.1f} GB on the first node, plan.cpu_ram_gb is {w.cpu_ram_gb:g}; request more "
                "memory (sbatch --mem) or run finalize on a larger host.")
    raise TypeError(f"no words for {type(w).__name__}")


def format_plan(p: Plan) -> str:
    c, m, ch, rb = p.cluster, p.memory, p.choice, p.recipe_batch
    lines = [f"plan: {p.recipe} on {c.nodes} x {c.gpus_per_node} {c.gpu_name} (world {c.world_size}); "
             f"model {p.model.n_params:,} parameters ({p.model.family} family)",
             f"  {ch.precision}, attention {ch.attention}, liger {'on' if ch.liger else 'off'}",
             f"\nper-GPU memory at seq_len {rb.seq_len:,} x micro-batch {rb.micro_batch_size}"
             + (" pair(s): a chosen and a rejected row each, fused DPO loss" if rb.rows_per_sample == 2 else "")
             + (f", each row shared by {rb.sequence_parallel} GPUs (sequence parallel: "
                f"{rb.seq_len // rb.sequence_parallel:,} tokens per GPU)" if rb.sequence_parallel > 1 else "")
             + ":"]
    for k, v in m.parts.items():
        lines.append(f"  {k:<36} {_gib(v)}")
    lines.append(f"  {'predicted peak':<36} {_gib(m.peak_bytes)}  of {_gib(m.capacity_bytes)}: "
                 f"{'fits' if m.fits else 'DOES NOT FIT'}")
    v = m.views
    lines.append(f"  {'as tools would report it':<36} max_memory_allocated {_gib(v.allocated).strip()}, "
                 f"max_memory_reserved {_gib(v.reserved).strip()}, nvidia-smi {_gib(v.nvidia_smi).strip()}")
    lines.append(f"  model states: {m.model_states_how}")
    if m.sm70_delta_bytes:
        lines.append(f"  sm70 attention backward: SDPA's memory-efficient kernel may compute delta outside the kernel "
                     f"here (if its 64x64 variant runs; unverified on a V100) (fp32 dO, O and their product, "
                     f"{m.sm70_delta_bytes / GiB:.2f} GiB) after the layer's MLP "
                     f"freed {m.mlp_saved_bytes / GiB:.2f} GiB: "
                     f"+{max(0, m.sm70_delta_bytes - m.mlp_saved_bytes) / GiB:.2f} GiB (planner/memory.py)")
    if rb.batch_error:
        lines.append(f"  batch: {rb.batch_error}")
    lines.append(f"\nchoices reaching exactly {rb.global_batch_tokens:,} tokens per optimizer step:")
    lines.append(f"  {'seq_len':>8} {'micro':>5} {'SP':>3} {'GA':>6} {'peak':>10}  fits  {'h/step':>6}")
    for o in p.options:
        mark = " <- recommended" if o == p.recommended else ""
        mark += " (recipe)" if o.recipe else ""
        hours = f"{o.seconds_per_step / 3600:6.2f}" if o.seconds_per_step else f"{'-':>6}"
        lines.append(f"  {o.seq_len:>8,} {o.micro_batch_size:>5} {o.sequence_parallel:>3} {o.grad_accum:>6} "
                     f"{_gib(o.peak_bytes)}  {'yes' if o.fits else 'no '}  {hours}{mark}")
    if p.recommended:
        lines.append("  recommended: the least time per token among those that fit with seq_len >= the data's p99 "
                     "document length (the recipe's seq_len before `make data`); the recipe's own unless another "
                     f"saves more than {RECOMMEND_GAIN:.0%}. SP: GPUs sharing each row, the fewest that fit "
                     "(train.sequence_parallel)")
    else:
        lines.append("  nothing fits. Try: " + "; ".join(suggestion(s) for s in p.suggestions))
    lines.append("\nevery phase of the job (peak per GPU, or host RAM per node):")
    lines.append(f"  {'phase':<12} {'peak':>10}  {'of capacity':>16}  fits  {'time':>9}  what")
    for name, ph in p.phases.items():
        unit = f"{ph.capacity_bytes / GiB:.2f} GiB {ph.limit}"
        verdict = ("yes" if ph.fits else "NO ") if ph.runs else "-  "
        lines.append(f"  {name:<12} {_gib(ph.peak_bytes)}  {unit:>16}  {verdict}   {_phase_time(name, ph):>9}  "
                     f"{ph.what}" + ("" if ph.runs else " (does not run: see the recipe)"))
    lines += _phase_time_notes(p)
    lines += format_replay(p)
    lines += format_time(p)
    d = p.data
    if d.steps_per_epoch is not None:
        lines.append(f"  data: {d.train_sequences:,} sequences = {d.steps_per_epoch:,} optimizer steps per "
                     f"epoch ({d.sequences_per_step:,} sequences each); {d.total_steps} in this run")
    else:
        lines.append(f"  data: not prepared yet (run `make data RECIPE={p.recipe}`) - steps per epoch unknown")
    lines += _format_disk(p)
    fin = p.phases.finalize
    lines.append(f"\nfinalize (after training, CPU): peak host RAM {fin.peak_bytes / 1e9:.1f} GB of "
                 f"{fin.capacity_bytes / 1e9:g} GB (plan.cpu_ram_gb): {'fits' if fin.fits else 'DOES NOT FIT'} ("
                 + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in fin.parts.items()) + " GB)")
    lines += _format_preemption(p)
    inf = p.inference
    lines.append(f"\ninference (GGUF, T4 {inf.t4_usable_gib} GiB usable, f16 KV {inf.kv_bytes_per_token / 1024:g} "
                 "KiB/token):")
    for q in inf.quant:
        mark = " (recipe)" if q.quant == inf.recipe_quant else ""
        lines.append(f"  {q.quant:<7} {_gib(q.gguf_bytes)}  T4: " + (
            f"fits, up to {q.t4_max_context:,} tokens context" if q.t4_fits else "does not fit") + mark)
    for w in p.warnings:
        lines.append(f"WARNING: {warning(w)}")
    return "\n".join(lines)


def _format_disk(p: Plan) -> list[str]:
    dk = p.disk
    lines = [f"\ndisk under output_dir: {_gib(dk.checkpoint_bytes).strip()} per checkpoint, "
             f"{_gib(dk.model_bytes).strip()} model; a fresh run at each event:"]
    for e in dk.events:
        held = "the new one:" if e.is_save else "model.tmp:    "
        lines.append(f"  {e.event:<26} {e.checkpoints_held} committed + {held} {_gib(e.bytes)}")
    h = dk.held
    if h.checkpoints:
        lines.append(f"  this run holds {h.checkpoints} committed checkpoint(s) ({_gib(h.checkpoint_bytes).strip()}): "
                     f"it still needs {_gib(dk.needed_free_bytes).strip()} free (at {dk.needed_at})")
    else:
        lines.append(f"  needs {_gib(dk.needed_free_bytes).strip()} free (at {dk.needed_at})")
    ws = dk.world_size_change
    if ws:
        lines.append(f"  resumed on another number of GPUs: the checkpoint is converted once to DeepSpeed's universal "
                     f"format beside it (reshard.py): +{_gib(ws.bytes).strip()} until it rotates away, "
                     f"{_gib(ws.peak_bytes).strip()} free while converting")
    return lines


def _format_preemption(p: Plan) -> list[str]:
    pe, ws = p.preemption, p.disk.world_size_change
    lines = [f"\npreemption (slurm/finetune.sbatch): a save takes ~{pe.save_s:,.0f} s at an assumed "
             f"{pe.save_bytes_per_s / 1e9:g} GB/s; recommended --signal=B:USR1@{pe.signal_lead_s} (one save + margin)"]
    if pe.idle_at_time_limit_s:
        lines.append(f"  time limit: the run stops at a step boundary with a checkpoint, no trained step lost; up to "
                     f"{pe.idle_at_time_limit_s / 3600:.2f} h of the allocation (a step + a save + margin) unused")
        # a warning at another time than the limit's (a preemption's USR1 with its GraceTime, `scancel
        # --signal=USR1`) has no deadline to plan by: the step in flight runs to its end before the save
        lines.append(f"  stopped by USR1 at any other time (preemption's grace, scancel --signal=USR1): the step in "
                     f"flight ends first, then the save: it needs {_h(pe.idle_at_time_limit_s)} of warning, "
                     "else the steps since the last save are lost")
    if ws:
        lines.append(f"  resubmitted on another number of GPUs: converting takes ~{_duration(ws.convert_s)} once, "
                     f"in the launcher (an estimate: {CONVERT_BYTES_PER_S / 1e6:g} MB/s measured at tiny scale), and "
                     f"each node's ranks then read it {ws.load_read_bytes_per_node // ws.bytes} times at load "
                     f"({ws.load_read_bytes_per_node / 1e9:,.0f} GB; once from storage if the page cache holds it)")
    if pe.lost_on_kill_s:
        lines.append(f"  killed without warning (node failure, scancel): up to {pe.lost_on_kill_s / 3600:.2f} h "
                     f"of training lost (train.save_steps={pe.save_steps}: the steps since "
                     "the last save); mid-step checkpoints are not implemented")
    return lines


def plot_memory(p: Plan, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = p.memory.parts
    fig, ax = plt.subplots(figsize=(6, 6))
    bottom = 0.0
    colors = plt.get_cmap("tab20").colors  # 11+ parts: tab10 would repeat a colour
    for i, (name, b) in enumerate(parts.items()):
        ax.bar([0], [b / GiB], bottom=bottom, color=colors[i % len(colors)], label=f"{name} ({b / GiB:.2f})")
        bottom += b / GiB
    ax.axhline(p.memory.capacity_bytes / GiB, color="k", linestyle="--", label="GPU memory")
    ax.set_xticks([0], [f"seq {p.recipe_batch.seq_len} x micro {p.recipe_batch.micro_batch_size}"])
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{p.recipe}: {p.cluster.world_size} x {p.cluster.gpu_name}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _loss_scale_note(r: Recipe, ga: int, steps: int | None, label_tokens_per_row: float | None) -> str:
    weight = ds_config.micro_step_weight(r, ga, label_tokens_per_row)
    power, window = ds_config.loss_scale(ga, steps, weight)
    what = (f"a DPO micro-step weighs {weight:.3g} of a mean-normalised one (beta {r.preference.beta}, "
            f"{label_tokens_per_row or ds_config.ASSUMED_LABEL_TOKENS_PER_ROW:,.0f} label tokens per row"
            f"{'' if label_tokens_per_row else ' assumed until `make data`'})" if r.pairs else f"GA {ga}")
    return (f" (DeepSpeed loss scale from 2^{power} for {what}, doubled after {window} overflow-free steps"
            f"{'' if steps else '; run length unknown before prepare'})")


def dry_run(p: Plan, r: Recipe) -> str:
    """The resolved plan for the target cluster, without a GPU."""
    c, ch, rb, m = p.cluster, p.choice, p.recipe_batch, p.memory
    ga = rb.grad_accum
    tokens = rb.seq_len * rb.micro_batch_size * c.world_size * ga if ga else None
    lines = [f"dry run: {r.name} (nothing launched)",
             f"  target         {c.nodes} node(s) x {c.gpus_per_node} {c.gpu_name}",
             f"  world size     {c.world_size}",
             f"  precision      {ch.precision}" + (_loss_scale_note(r, ga, p.data.total_steps,
                                                                    p.data.label_tokens_per_row)
                                                   if ch.precision == "fp16" and r.train.deepspeed else ""),
             f"  attention      {ch.attention}",
             f"  Liger kernels  {'on' if ch.liger else 'off'}",
             f"  seq_len        {rb.seq_len:,}",
             f"  micro-batch    {rb.micro_batch_size}",
             f"  grad-accum     {ga if ga else 'INVALID: ' + rb.batch_error}",
             f"  tokens/step    {tokens:,}" if tokens else "  tokens/step    n/a",
             f"  gradient checkpointing {'on' if r.train.gradient_checkpointing else 'off'}; "
             f"DeepSpeed {r.train.deepspeed or 'off'}",
             f"  memory/GPU     {m.peak_bytes / GiB:.2f} GiB predicted of {m.capacity_bytes / GiB:.2f} GiB: "
             f"{'fits' if m.fits else 'DOES NOT FIT'}"]
    for k, v in m.parts.items():
        lines.append(f"    {k:<36} {v / GiB:6.2f} GiB")
    gpu = [f"{n} {ph.peak_bytes / GiB:.1f}" for n, ph in p.phases.items() if n != "train_step" and ph.limit == "gpu"]
    bad = [n for n, ph in p.phases.items() if ph.runs and not ph.fits]
    lines.append(f"  other phases   {', '.join(gpu)} GiB per GPU; "
                 + ("every phase fits" if not bad else "DO NOT FIT: " + ", ".join(bad))
                 + " (`zerotune plan` shows all)")
    t = p.time
    if t.seconds_per_step:
        lines.append(f"  time/step      {t.seconds_per_step / 3600:.2f} h: "
                     + ", ".join(f"{k} {v / 3600:.2f}" for k, v in t.terms.items())
                     + f" h; dominated by {t.dominant} ({t.mfu:.0%} MFU, cluster {t.cluster}; "
                     "`zerotune plan` shows 1-8 nodes)")
    for why in ch.reasons:
        lines.append(f"  ({why})")
    lines += [f"  WARNING: {warning(w)}" for w in p.warnings]
    return "\n".join(lines)
