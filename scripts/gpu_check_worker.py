#!/usr/bin/env python
"""What runs inside each process scripts/gpu_check.py starts: one check, as the card it emulates, its rows as JSON.

    python scripts/gpu_check_worker.py CHECK SPEC.json      (gpu_check.py run_worker starts it; its last stdout
                                                             line is ROW_MARK + {"rows": [...], "info": {...}})

CHECK is env (the card, versions and emulation), fp16_loss_scale, sdpa_packed, liger or zero3. Each applies
zerotune.emulation.emulate for spec["as"] around everything it runs. The training rows go through train/worker.py's
own functions in the worker's order (kit_trainer: StopOnSignal, load_model, build_trainer, choose_resume,
train_or_stop) with train/args.py's TrainingArguments and ds_config.build's DeepSpeed config; only worker.setup is
replaced (kit_run), because it reads prepared data (a tokenizer and `make data`) and the real card.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import GiB, NEW_TOKENS, ROW_MARK, _reason, make_row, recipe, small_config  # noqa: E402
from zerotune.emulation import EmulationError, card_key, emulate, this_card  # noqa: E402

DOC_TOKENS = 1024  # tokens per packed document: plan.py's ASSUMED_ATTENTION_SPAN, so the plan times these rows
N_VAL_ROWS = 2
OVERFLOW_FACTOR = 1e20  # loss x this: fp16 gradients overflow at any loss scale >= 1


# --------------------------------------------------------------------------------------------------------------
# Rows of packed documents
# --------------------------------------------------------------------------------------------------------------

def packed_rows(n: int, seq: int, vocab: int, seed: int, doc: int = DOC_TOKENS) -> list[dict]:
    """n packed rows of documents of `doc` tokens (the last one shorter): position_ids restart at 0 per document,
    as data/packing.py packs; the first 8 tokens of each document carry no loss (a prompt)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    starts = range(0, seq, doc)
    pos = [i - s for s in starts for i in range(s, min(s + doc, seq))]
    rows = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (seq,), generator=g).tolist()
        labels = [-100 if i - s < 8 else t for s in starts for i, t in enumerate(ids[s:s + doc], s)]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return rows


# --------------------------------------------------------------------------------------------------------------
# Worker side: helpers
# --------------------------------------------------------------------------------------------------------------

def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Measure:
    """Peak max_memory_allocated / max_memory_reserved and wall time of a block (peaks reset at entry)."""
    allocated = reserved = seconds = None

    def __enter__(self):
        import torch

        if _cuda():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        self.seconds = time.perf_counter() - self.t0
        try:
            if _cuda():
                torch.cuda.synchronize()
                self.seconds = time.perf_counter() - self.t0
                self.allocated, self.reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        except Exception:  # a CUDA error inside the block (sticky): report that one, not this
            if exc[0] is None:
                raise
        return False

    def cols(self) -> dict:
        return {"allocated": self.allocated, "reserved": self.reserved, "seconds": self.seconds}


def _fail(check: str, e: BaseException, m: Measure | None = None) -> dict:
    traceback.print_exc()  # into the check's log
    return make_row(check, "FAIL", _reason(e), **(m.cols() if m and m.seconds is not None else {}))


def finish(name: str, problems: list[str], detail: str, guard, m: Measure | None = None, **cols) -> dict:
    """A row: FAIL with the problems (an SDPA math fallback the guard saw is one) before the detail, else ok."""
    fallback = guard.take() if guard else None
    problems = problems + ([fallback] if fallback else [])
    return make_row(name, "FAIL" if problems else "ok", "; ".join(problems + [detail]),
                    **{**(m.cols() if m else {}), **cols})


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-30))


def logits_tolerance(dtype, scale: float) -> float:
    """Max |logit difference| between two computations of the same logits that differ only in kernel: a few ulps
    of the dtype at the logits' magnitude, summed over a few layers."""
    import torch

    return {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype] * max(1.0, scale)


def build_model(cfg: dict, dtype, attention_name: str):
    """A random-init model of `cfg` on this device, zerotune's attention registered (attention.load_name)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotune import attention

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype, attn_implementation=attention
                                            .load_name(attention_name)).to("cuda" if torch.cuda.is_available() else "cpu")


def loss_and_grads(model, ids) -> tuple[float, dict]:
    """Training-mode loss on `ids` (labels = ids) and a copy of every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def worker_env(spec: dict) -> dict:
    import importlib.metadata as md

    import torch

    props, cap = torch.cuda.get_device_properties(0), torch.cuda.get_device_capability(0)
    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "liger-kernel", "accelerate", "triton", "flash-attn"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    info = {"name": props.name, "capability": list(cap), "total_memory": props.total_memory,
            "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "arch_list": torch.cuda.get_arch_list(), "versions": versions, "card": card_key(cap, props.name)}
    try:
        info["emulation"] = asdict(this_card(spec["as"]))
    except EmulationError as e:
        info["emulation_error"] = str(e)
    return {"rows": [], "info": info}


# --------------------------------------------------------------------------------------------------------------
# The worker's own training path (train/worker.py) on rows made here
# --------------------------------------------------------------------------------------------------------------

def write_base(r, dtype) -> bool:
    """launch.materialise_base's job: random weights from model.init_config (seed model.init_seed) into the run's
    base folder, here initialised on the device in the training dtype and without the tokenizer (materialise_base
    initialises in fp32 on the CPU: ~1 minute of a lent GPU's time at 8B width). Called before any
    TrainingArguments exist, which would build this model under zero.Init. False: already there."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotune.config import resolve_path
    from zerotune.layout import layout

    base = layout(r).base
    if any(base.glob("*.safetensors")):
        return False
    torch.manual_seed(r.model.init_seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(resolve_path(r.model.init_config))),
                                                 dtype=dtype)
    model.save_pretrained(str(base))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return True


def kit_run(r, gpu, rows: list[dict]):
    """worker.setup's Run for this recipe, from rows made here: setup reads the prepared data and its manifest
    (require_prepared: a tokenizer and `make data`) and the real card (hardware.detect). The rest as setup does
    it: the family from the base's config, hardware.choose, the batch plan, the step count, TrainingArguments
    before the model (zero.Init), DeepSpeed's process group, its warning filter."""
    import warnings

    import datasets
    import deepspeed
    import torch

    from zerotune import batch as batchmod
    from zerotune import hardware
    from zerotune.layout import layout
    from zerotune.ports import free_port
    from zerotune.train import worker
    from zerotune.train.args import collate_packed, total_steps, training_arguments

    warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor).* is deprecated",
                            category=FutureWarning)
    paths = layout(r)
    family = worker.model_family(paths.base)
    choice = hardware.choose(gpu, r.train.precision, r.train.attention, r.train.liger, family=family)
    bp = batchmod.derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 1)
    train_ds = datasets.Dataset.from_list(rows)
    steps = total_steps(len(train_ds), bp, r)
    args = training_arguments(r, bp, choice, gpu.capability is not None, steps)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # world size 1, as torchrun would set it
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    tokens = {"train_label": sum(x != -100 for row in rows for x in row["labels"]),
              "train_total": sum(len(row["labels"]) for row in rows)}
    return worker.Run(paths, 0, 1, gpu, choice, bp, {"tokens": tokens, "pad_token_id": 0}, train_ds, steps, args,
                      collate_packed, family=family)


def kit_trainer(r, gpu, rows: list[dict]):
    """train/worker.py worker's steps in its order: StopOnSignal, [setup: kit_run], load_model, build_trainer,
    choose_resume. Without the in-training validation and samples callback: the kit measures them as phases.
    Returns (run, model, n_params, trainer, stop, commit, resume)."""
    from zerotune.train import worker
    from zerotune.train.callbacks import StopOnSignal
    from zerotune.train.validation import EvalDuringTraining

    stop = StopOnSignal()
    run = kit_run(r, gpu, rows)
    model, n_params, _ = worker.load_model(r, run)
    trainer, _safety, metrics, commit = worker.build_trainer(r, run, model, n_params, stop)
    trainer.remove_callback(EvalDuringTraining)
    return run, model, n_params, trainer, stop, commit, worker.choose_resume(r, run, metrics)


def make_clock(reset_peaks: bool):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """Peaks reset once DeepSpeed's engine exists (on_train_begin, transformers 5.23 trainer.py:1653, follows
        deepspeed_init at :1730); per optimizer step the first micro-step alone (on_step_begin to on_substep_end,
        :1894, :1961) and the whole step (to on_step_end, :1949)."""

        def __init__(self):
            self.micro, self.steps, self.t = [], [], 0.0

        def on_train_begin(self, *a, **kw):
            import torch

            if reset_peaks and _cuda():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, *a, **kw):
            _sync()
            self.t = time.perf_counter()

        def on_substep_end(self, *a, **kw):
            if len(self.micro) == len(self.steps):
                _sync()
                self.micro.append(time.perf_counter() - self.t)

        def on_step_end(self, *a, **kw):
            _sync()
            self.steps.append(time.perf_counter() - self.t)

    return Clock()


def fingerprint(engine, n_layers: int) -> dict:
    """Sums of some 16-bit weights (local partitions: the whole tensor at world size 1), of the fp32 master
    partitions (stage3.py fp32_partitioned_groups_flat), the loss scale and the step: what a resume restores."""
    ends = ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", f"layers.{n_layers - 1}.mlp.down_proj.weight",
            "model.norm.weight", "lm_head.weight")
    fp = {n: float(getattr(p, "ds_tensor", p).detach().double().sum())
          for n, p in engine.module.named_parameters() if n.endswith(ends)}
    master = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if master:
        fp["fp32 master"] = float(sum(t.detach().double().sum() for t in master if t.numel()))
    if engine.fp16_enabled():
        fp["loss scale"] = float(engine.optimizer.cur_scale)
    return {**fp, "step": int(engine.global_steps)}


# --------------------------------------------------------------------------------------------------------------
# Checks (worker side)
# --------------------------------------------------------------------------------------------------------------

def check_fp16_loss_scale(spec: dict) -> dict:
    """A tiny Llama through the worker's Trainer in fp16: DeepSpeed's loss scaler as ds_config.build configures it,
    the "auto" values filled by the Trainer itself (integrations/deepspeed.py trainer_config_process/finalize)."""
    import torch
    from transformers import TrainerCallback

    from zerotune import metrics as mx
    from zerotune.train.worker import train_or_stop

    name, r, hysteresis = "fp16 loss scale (Trainer + DeepSpeed ZeRO-3)", recipe(spec["recipe"]), spec["hysteresis"]
    overflow = set(range(2, 2 + hysteresis))

    class OverflowProbe(TrainerCallback):
        """Loss x OVERFLOW_FACTOR on the steps in `overflow` (as faults.NaNLossAt injects a NaN); per step the
        scaler (metrics.fp16_scaler) and whether a weight changed."""

        def __init__(self, trainer, model):
            self.trainer, self.trail, self.step = trainer, [], 0
            self.probe = model.model.layers[0].self_attn.q_proj.weight  # gets a gradient every step
            model.register_forward_hook(self._hook)

        def _hook(self, module, inputs, output):
            if module.training and self.step in overflow and getattr(output, "loss", None) is not None:
                output.loss = output.loss.float() * OVERFLOW_FACTOR
            return output

        def _snap(self):
            return getattr(self.probe, "ds_tensor", self.probe).detach().clone()

        def on_step_begin(self, args, state, control, **kw):
            self.step, self.before = state.global_step + 1, self._snap()

        def on_step_end(self, args, state, control, **kw):
            s = mx.fp16_scaler(mx.deepspeed_engine(self.trainer))
            self.trail.append({**s, "step": self.step, "changed": not bool((self._snap() == self.before).all())})

    m, emu = Measure(), this_card(spec["as"])
    with emulate(emu) as guard:
        try:
            write_base(r, torch.float16)
            rows = packed_rows(r.train.max_steps, r.data.seq_len, 1024, seed=0, doc=r.data.seq_len)
            run, model, _n, trainer, stop, commit, resume = kit_trainer(r, emu.gpu, rows)
            probe = OverflowProbe(trainer, model)
            trainer.add_callback(probe)
            with m:
                train_or_stop(r, run, trainer, stop, commit, resume)
            cfg = trainer.args.hf_deepspeed_config.config["fp16"]  # as the Trainer filled it
            s0, trail = 2.0 ** cfg["initial_scale_power"], probe.trail
            problems = [] if cfg.get("hysteresis") == hysteresis else [f"hysteresis {cfg.get('hysteresis')}"]
            for t in trail:
                want = s0 if t["step"] - 1 < hysteresis else s0 / 2  # halved at the hysteresis-th overflow
                if t["overflow"] != (t["step"] in overflow) or t["changed"] == (t["step"] in overflow) \
                        or t["loss_scale"] != want:
                    problems.append(f"step {t['step']}: scale {t['loss_scale']:g} (expected {want:g}), overflow "
                                    f"{t['overflow']}, weights changed {t['changed']}")
            if len(trail) != r.train.max_steps or trail[-1]["skipped_steps"] != hysteresis:
                problems.append(f"{len(trail)} steps, {trail[-1]['skipped_steps'] if trail else '?'} skipped")
            scales = " -> ".join(f"{t['loss_scale']:g}" for t in trail)
            return {"rows": [finish(name, problems, (
                f"scale {scales} over steps 1..{len(trail)} (steps "
                f"{sorted(overflow)}: loss x {OVERFLOW_FACTOR:g}, hysteresis {hysteresis}); skipped steps left the "
                f"weights alone, normal steps before and after applied; {run.choice.describe()}"), guard, m)]}
        except Exception as e:
            return {"rows": [_fail(name, e, m)]}


def packed_vs_documents(model, lens: tuple[int, ...], vocab: int, seed: int = 0) -> dict:
    """Logits of documents packed in one row (position_ids restarting at 0) against each document alone, in the
    model's mode with use_cache=False. The control packs the same row without position_ids (one causal document):
    its difference must exceed the tolerance, or the comparison could not see a leak."""
    import torch

    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, vocab, (1, n), generator=g).to(dev) for n in lens]
    ids, pos = torch.cat(docs, dim=1), torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(dev)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
        alone = torch.cat([model(input_ids=d, use_cache=False).logits.float() for d in docs], dim=1)
        control = model(input_ids=ids, use_cache=False).logits.float()
    scale = float(alone.abs().max())
    return {"max_diff": float((packed - alone).abs().max()), "control_diff": float((control - alone).abs().max()),
            "tol": logits_tolerance(next(model.parameters()).dtype, scale), "ids": ids, "pos": pos, "alone": alone}


SDPA_OPS = (("efficient_attention", "memory-efficient"), ("flash_attention", "flash"), ("cudnn_attention", "cuDNN"),
            ("attention_math", "math"))


def sdpa_backends_used(fn) -> list[str]:
    """SDPA backends whose aten op ran inside fn() (torch profiler, CPU-side op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    return [label for op, label in SDPA_OPS if any(op in n for n in names)]


def check_sdpa_packed(spec: dict) -> dict:
    """Two packed documents under each attention the card may train with, same weights: packed logits equal each
    document's alone (computed under sdpa_docs, one document per call), forward + backward, the backend that ran."""
    import torch

    from zerotune import hardware
    from zerotune.families import FAMILIES
    from zerotune.verify import model_dtype

    rows, lens, emu = [], (40, 56), this_card(spec["as"])
    with emulate(emu) as guard:
        dtype = model_dtype(hardware.choose(emu.gpu, family=FAMILIES["llama"]).precision)
        kinds = ["sdpa_docs", "sdpa"] + (["flash_attention_2"] if emu.gpu.flash_attention_2
                                         and hardware.flash_attn_installed() else [])
        cfg = small_config("llama", vocab_size=1024, hidden_size=256, intermediate_size=512, head_dim=32,
                           initializer_range=0.1)  # larger weights: attention across documents moves logits
        torch.manual_seed(0)
        model = build_model(cfg, dtype, "sdpa_docs").train()
        res = packed_vs_documents(model, lens, cfg["vocab_size"])
        guard.take()  # the references are not what the rows check
        for kind in kinds:
            name, m = f"sdpa packed: {kind} ({str(dtype).removeprefix('torch.')})", Measure()
            try:
                model.set_attn_implementation(kind)
                batch = {"input_ids": res["ids"], "position_ids": res["pos"], "use_cache": False}
                with m:
                    loss = model(**batch, labels=res["ids"]).loss
                    loss.backward()
                    with torch.no_grad():
                        packed = model(**batch).logits.float()
                with torch.no_grad():
                    used = sdpa_backends_used(lambda: model(**batch))
                finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
                model.zero_grad(set_to_none=True)
                diff = float((packed - res["alone"]).abs().max())
                problems = [p for p, bad in (
                    ("packed logits differ from per-document logits", not diff <= res["tol"]),
                    ("control: cross-document attention is below the tolerance", not res["control_diff"] > res["tol"]),
                    ("non-finite loss or gradients", not (finite and torch.isfinite(loss))),
                    ("SDPA ran its math kernel (S x S scores)", "math" in used)) if bad]
                rows.append(finish(name, problems, f"docs {'+'.join(map(str, lens))}, train mode: packed vs "
                                   f"per-document max |dlogit| {diff:.2e} (tol {res['tol']:.1e}); without the "
                                   f"documents {res['control_diff']:.2e}; SDPA ran: {', '.join(used) or 'none'}",
                                   guard, m))
            except Exception as e:
                guard.take()
                rows.append(_fail(name, e, m))
        if "flash_attention_2" not in kinds:
            rows.append(make_row("sdpa packed: flash_attention_2", "skipped", f"{emu.gpu.name}: no FlashAttention 2 "
                                 "(sm80+, flash-attention #891)" if not emu.gpu.flash_attention_2 else
                                 "flash_attn not installed (pip install -e .[flash])"))
    return {"rows": rows}


def shard_attention(heads: int, kv_heads: int, head_dim: int, docs: tuple[int, ...], dtype, device) -> dict:
    """What one GPU of a sequence-parallel group attends after DeepSpeed's Ulysses exchange: every token of the
    row for its heads / N query heads and their K/V heads (ulysses_sp.py _combine_local_sequences), through
    sdpa_docs with the row's gathered position_ids, forward and backward. Returns the output's and the gradients'
    finiteness and the SDPA backends that ran."""
    import torch

    from zerotune.attention import document_attention

    class Layer:  # what transformers' attention interface reads from the layer
        num_key_value_groups, is_causal = heads // kv_heads, True

    seq = sum(docs)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, n, seq, head_dim, generator=g).to(device, dtype).requires_grad_()
               for n in (heads, kv_heads, kv_heads))
    pos = torch.cat([torch.arange(d) for d in docs]).unsqueeze(0).to(device)

    def step():
        out, _ = document_attention(Layer(), q, k, v, None, position_ids=pos, scaling=head_dim ** -0.5)
        out.float().square().mean().backward()
        return out

    used = sdpa_backends_used(step)
    return {"finite": all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v)), "used": used, "seq": seq}


def check_sp_attention(spec: dict) -> dict:
    """Issue 52 on one card: the attention one GPU of Llama-3.1-8B's sequence-parallel group runs at a 32K row
    (N = 2: 16 query heads, 4 K/V heads, every token), in the emulated card's kernels and precision, with one 32K
    document (the longest case: the memory-efficient kernel's causal path over 32K keys) and a mix of long ones.
    Its peak beside the plan's one-layer recompute at the same tokens per GPU (the transient budget the attention
    lives in). One card cannot run the exchange itself: the all-to-alls and their time need 2+ GPUs."""
    import torch

    from zerotune import hardware
    from zerotune.config import load_recipe
    from zerotune.families import FAMILIES
    from zerotune.planner.target import resolve
    from zerotune.verify import model_dtype

    rows, emu = [], this_card(spec["as"])
    seq, sp = spec["seq"], spec["sp"]
    budget = resolve(load_recipe("llama8b_long_zero3", [f"data.seq_len={seq}", f"train.sequence_parallel={sp}"]),
                     gpu=spec["plan_gpu"]).memory(seq, 1)["parts"]["one-layer recompute"]
    with emulate(emu) as guard:
        dtype = model_dtype(hardware.choose(emu.gpu, family=FAMILIES["llama"]).precision)
        for label, docs in (("one document", (seq,)), ("long documents", (seq // 2, seq // 4, seq // 8, seq // 8))):
            name, m = f"sp attention {seq:,}/{sp}: {label}", Measure()
            try:
                with m:
                    got = shard_attention(32 // sp, 8 // sp, 128, docs, dtype, "cuda")
                problems = [p for p, bad in (("non-finite gradients", not got["finite"]),
                                             ("SDPA ran its math kernel (S x S scores)", "math" in got["used"]),
                                             ("peak above the plan's one-layer recompute", (m.allocated or 0) > budget))
                            if bad]
                rows.append(finish(name, problems, f"{32 // sp} query / {8 // sp} K/V heads x {seq:,} tokens, docs "
                                   f"{'+'.join(map(str, docs))}, {str(dtype).removeprefix('torch.')}; SDPA ran: "
                                   f"{', '.join(got['used']) or 'none'}; plan's one-layer recompute "
                                   f"{budget / GiB:.2f} GiB", guard, m, predicted_allocated=budget))
            except Exception as e:
                guard.take()
                rows.append(_fail(name, e, m))
            torch.cuda.empty_cache()
    return {"rows": rows}


def check_liger(spec: dict) -> dict:
    """Each family patched by families.apply_liger (as worker.load_model does), in the precision zerotune picks for
    it on the (emulated) card: train loss and gradients against the same weights in fp32 (16-bit noise alone
    moves a gradient ~9%), eval logits against the unpatched model; Llama also validates through
    validation.nll_sum with Liger's fused loss, which must not allocate a seq x vocab tensor."""
    import torch

    from zerotune import families, hardware
    from zerotune.train import validation
    from zerotune.verify import model_dtype

    rows, seq, emu = [], 4096, this_card(spec["as"])
    dev = torch.device("cuda" if _cuda() else "cpu")
    with emulate(emu) as guard:
        for family in spec["families"]:
            fam, m = families.FAMILIES[family], Measure()
            choice = hardware.choose(emu.gpu, family=fam)
            dtype = model_dtype(choice.precision)
            name = f"liger {family} ({str(dtype).removeprefix('torch.')}, {choice.attention})"
            try:
                cfg = small_config(family)
                ids = torch.randint(2, cfg["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(dev)
                val = packed_rows(1, seq, cfg["vocab_size"], seed=2)
                torch.manual_seed(0)
                ref = build_model(cfg, dtype, choice.attention)
                loss0, grads0 = loss_and_grads(ref, ids)
                ref.eval()
                ref.zero_grad(set_to_none=True)
                with torch.no_grad():
                    logits0 = ref(input_ids=ids[:, :512], use_cache=False).logits.float()
                    nll0 = validation.nll_sum(ref, val, dev)[0]
                state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
                _, grads32 = loss_and_grads(ref.float(), ids)  # the yardstick for both 16-bit runs
                del ref

                families.apply_liger(fam)  # before instantiation, as train/worker.py load_model
                patched = build_model(cfg, dtype, choice.attention)
                patched.load_state_dict(state)
                layer, mlp = patched.model.layers[0], next(k for k in ("swiglu", "geglu") if k in fam.liger_kernels)
                missing = [what for what, mod in (("RMSNorm", patched.model.norm), (mlp, layer.mlp), *(
                    (("q_norm", layer.self_attn.q_norm), ("k_norm", layer.self_attn.k_norm)) if fam.qk_norm else ()))
                           if "liger" not in type(mod).__module__]
                if missing or "liger" not in type(patched).forward.__module__:
                    raise RuntimeError(f"Liger did not patch: {', '.join(missing) or 'the fused linear CE forward'}")
                with m:
                    loss1, grads1 = loss_and_grads(patched, ids)
                # Liger's error against fp32, per tensor, over the unpatched model's own (floor 1e-3: fp32 itself)
                excess = {n: _rel(grads1[n], grads32[n]) / max(_rel(grads0[n], grads32[n]), 1e-3) for n in grads0}
                worst, finite = max(excess, key=excess.get), all(bool(torch.isfinite(v).all()) for v in grads1.values())
                del state, grads0, grads1, grads32
                patched.eval()
                patched.zero_grad(set_to_none=True)
                with torch.no_grad():
                    logit_diff = float((patched(input_ids=ids[:, :512], use_cache=False).logits.float()
                                        - logits0).abs().max())
                tol = logits_tolerance(dtype, float(logits0.abs().max())) if dtype != torch.float32 else 1e-3
                problems = [p for p, bad in (("non-finite gradients", not finite),
                                             ("train loss differs", not abs(loss1 - loss0) <= 5e-3 * abs(loss0)),
                                             ("gradients further from fp32 than the unpatched model's",
                                              not excess[worst] <= 2.0),
                                             ("eval logits differ", not logit_diff <= tol)) if bad]
                cap = torch.cuda.get_device_capability(0) if _cuda() else None
                rows.append(finish(name, problems, (
                    f"seq {seq}, head_dim {cfg['head_dim']}: train loss {loss1:.5f} vs unpatched {loss0:.5f}; against "
                    f"fp32, Liger's gradient error at most {excess[worst]:.2f}x the unpatched model's ({worst}; tol "
                    f"2x); eval logits max diff {logit_diff:.1e} (tol {tol:.1e}); capability Liger read: {cap}; "
                    f"families.apply_liger ({fam.liger})"), guard, m))
                if family == "llama":  # validation: the same NLL, and peak growth below one fp16 logits tensor
                    m, limit = Measure(), seq * cfg["vocab_size"] * 2
                    before = torch.cuda.memory_allocated() if _cuda() else 0
                    with m, torch.no_grad():
                        nll1, count = validation.nll_sum(patched, val, dev, liger=True)
                    grew = (m.allocated or 0) - before
                    rows.append(finish("liger llama: validation (validation.nll_sum, skip_logits)", [p for p, bad in (
                        ("validation NLL differs", not abs(nll1 - nll0) <= 5e-3 * abs(nll0)),
                        ("a seq x vocab tensor was allocated", _cuda() and grew >= limit)) if bad],
                        f"NLL sum {nll1:.1f} vs unpatched {nll0:.1f} over {count:,} tokens; the peak grew "
                        f"{grew / 2**20:.0f} MiB over the weights, one fp16 logits tensor is {limit / 2**20:.0f} MiB",
                        guard, m))
                del patched
                if _cuda():
                    torch.cuda.empty_cache()
            except Exception as e:
                guard.take()
                rows.append(_fail(name, e, m))
    return {"rows": rows}


class Skip(Exception):
    """A phase that cannot run here, and why."""


def check_zero3(spec: dict) -> dict:
    """One ZeRO-3 row set through the worker's own functions (kit_trainer), a row per phase: train
    (worker.train_or_stop), validation (validation.distributed_val_loss, the in-training validation), samples
    (generate after a seq-token prompt: the planner's bound), save (Trainer._save_checkpoint, then on_save:
    CommitCheckpoints commits it). With spec["resume"]: a fresh process whose choose_resume finds that checkpoint
    and whose train_or_stop loads it (at max_steps: nothing left to train); weights, fp32 master, loss scale, step
    and validation loss must equal what was saved. An out-of-memory the plan predicts is ok."""
    import torch

    from zerotune import hardware
    from zerotune.train import validation, worker
    from zerotune.checkpoint import last_committed
    from zerotune.config import resolve_path
    from zerotune.families import of_config
    from zerotune.layout import layout
    from zerotune.verify import model_dtype

    r, tag, expect, resuming = recipe(spec["recipe"]), spec["tag"], spec["expect"], spec.get("resume")
    emu, seq, info = this_card(spec["as"]), r.data.seq_len, {"saved": False}
    dev = torch.device("cuda" if _cuda() else "cpu")
    vocab = json.loads(resolve_path(r.model.init_config).read_text())["vocab_size"]
    with emulate(emu) as guard:
        try:
            choice = hardware.choose(emu.gpu, r.train.precision, r.train.attention, r.train.liger,
                                     family=of_config(resolve_path(r.model.init_config)))
            wrote = write_base(r, model_dtype(choice.precision))
            run, model, n_params, trainer, stop, commit, resume = kit_trainer(
                r, emu.gpu, packed_rows(r.train.max_steps * 2, seq, vocab, seed=0))
            if n_params != spec["n_params"]:
                raise RuntimeError(f"built {n_params:,} parameters, the plan counts {spec['n_params']:,}")
            clock = make_clock(reset_peaks=not resuming)
            trainer.add_callback(clock)
            val, n_layers = packed_rows(N_VAL_ROWS, seq, vocab, seed=1), model.config.num_hidden_layers
        except Exception as e:
            guard.take()
            return {"rows": [_fail(f"{tag}: {'resume' if resuming else 'setup'}", e)], "info": info}

        def validate():
            trainer.model.eval()
            with torch.no_grad():
                return validation.distributed_val_loss(trainer.model, val, dev, run.choice.liger)

        def train():
            worker.train_or_stop(r, run, trainer, stop, commit, resume)
            _sync()
            eng, losses = trainer.model_wrapped, [h["loss"] for h in trainer.state.log_history if "loss" in h]
            micro = statistics.median(clock.micro[1:] or clock.micro) if clock.micro else None
            step = statistics.median(clock.steps[1:] or clock.steps)
            info.update(losses=losses, micro_s=micro, step_s=step)
            problems = [p for p, bad in (
                (f"stopped at step {trainer.state.global_step}", trainer.state.global_step != r.train.max_steps),
                (f"non-finite or missing losses {losses}", not losses or not all(map(math.isfinite, losses))),
                ("every step was skipped (overflow)", eng.skipped_steps >= r.train.max_steps)) if bad]
            peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if _cuda() else (None, None)
            return problems, (
                f"{run.choice.describe()}, checkpointing, GA {run.bp.grad_accum}, {n_params:,} parameters"
                f"{' (base written)' if wrote else ''}: median {micro or float('nan'):.3f} s per micro-step, {step:.2f} "
                f"s per step after the first, {run.bp.global_batch_tokens / step:,.0f} tokens/s; losses "
                f"{', '.join(f'{x:.3f}' for x in losses)}; skipped steps {eng.skipped_steps}"
                + (f", loss scale {float(eng.optimizer.cur_scale):g}" if eng.fp16_enabled() else "")), dict(
                allocated=peaks[0], reserved=peaks[1], seconds=micro)  # the peaks since the engine exists

        def validation_phase():  # not `validation`: the module of that name is used above
            loss, count = validate()
            info["val_loss"] = loss
            return [] if math.isfinite(loss) and count else ["no finite loss"], (
                f"validation.distributed_val_loss{' (Liger: skip_logits)' if run.choice.liger else ''}, {N_VAL_ROWS} "
                f"packed rows of {seq:,} tokens: loss {loss:.4f} ({count:,} tokens)"), {}

        def samples():
            prompt = torch.randint(2, vocab, (1, seq), generator=torch.Generator().manual_seed(2)).to(dev)
            trainer.model.eval()
            use_cache = trainer.model.config.use_cache
            try:
                with torch.no_grad():
                    gen = trainer.model.generate(
                        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, pad_token_id=0, temperature=None,
                        top_p=None, top_k=None, synced_gpus=False)
            finally:
                trainer.model.config.use_cache = use_cache  # as train/validation.py restores it after generate()
            new = gen.shape[1] - seq
            return [] if new == NEW_TOKENS else [f"{new} new tokens"], (
                f"greedy generate, {seq:,}-token prompt (the planner's bound), KV cache: {new} new tokens"), {}

        def save():
            trainer.model.train()
            out = layout(r).checkpoints
            need, free = n_params * 16, shutil.disk_usage(out).free  # fp32 master + Adam (12 B) + 16-bit twice
            if free < need:
                raise Skip(f"needs ~{need / 1e9:.0f} GB free in {out}, has {free / 1e9:.0f} GB (--tmpdir elsewhere)")
            trainer._save_checkpoint(trainer.model, trial=None)  # what a save_steps step runs, then its callbacks
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
            ckpt = last_committed(out, quiet=True)
            if ckpt is None or not any(ckpt.glob("global_step*")):
                raise RuntimeError(f"no committed DeepSpeed checkpoint in {out}")
            info.update(saved=True, fingerprint=fingerprint(trainer.model_wrapped, n_layers))
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            return [], f"Trainer._save_checkpoint + on_save (CommitCheckpoints: {ckpt.name}): {size / 1e9:.1f} GB", {}

        def resumed():
            if resume is None:
                raise RuntimeError("choose_resume found no committed checkpoint")
            worker.train_or_stop(r, run, trainer, stop, commit, resume)
            got, saved = fingerprint(trainer.model_wrapped, n_layers), resuming["fingerprint"]
            problems = [f"{k} {got.get(k)} != saved {v}" for k, v in saved.items()
                        if got.get(k) is None or abs(got[k] - v) > 1e-6 * max(1.0, abs(v))]
            loss, want = validate()[0], resuming.get("val_loss")
            if want is not None and not abs(loss - want) <= 1e-3 * abs(want):
                problems.append(f"validation after resume {loss:.5f}, before save {want:.5f}")
            return problems, (f"fresh process: choose_resume -> {resume.name}, train_or_stop -> engine.load_checkpoint, "
                              f"step {got['step']}; {len(saved) - len(problems)}/{len(saved)} fingerprints equal "
                              f"({', '.join(saved)}); validation loss {loss:.4f}; peak and time include the engine's "
                              "initialisation"), {}

        steps = {"train": train, "validation": validation_phase, "samples": samples, "save": save, "resume": resumed}
        rows = []
        for i, phase in enumerate(["resume"] if resuming else spec["phases"]):
            name, m = f"{tag}: {phase}", Measure()
            try:
                with m:
                    problems, detail, cols = steps[phase]()
                rows.append(finish(name, problems, detail, guard, m, **cols))
            except Skip as e:
                rows.append(make_row(name, "skipped", str(e)))
            except Exception as e:
                guard.take()
                peak = expect["peaks"].get(phase)
                if isinstance(e, torch.OutOfMemoryError) and peak and peak > expect["capacity"]:
                    rows.append(make_row(name, "ok", f"out of memory, as the plan predicts ({peak / GiB:.2f} GiB > "
                                         f"{expect['capacity'] / GiB:.2f}): {_reason(e)[:200]}", **m.cols()))
                else:
                    rows.append(_fail(name, e, m))
                if phase == "train":
                    rows += [make_row(f"{tag}: {p}", "skipped", "the train phase failed") for p in spec["phases"][i + 1:]]
                    break
    return {"rows": rows, "info": info}


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------

CHECKS = {"env": worker_env, "fp16_loss_scale": check_fp16_loss_scale, "sdpa_packed": check_sdpa_packed,
          "liger": check_liger, "zero3": check_zero3, "sp_attention": check_sp_attention}


def main(argv: list[str] | None = None) -> int:
    name, spec = argv or sys.argv[1:]
    try:
        payload = CHECKS[name](json.loads(Path(spec).read_text()))
    except Exception as e:  # the checks catch their own; this is the last net
        payload = {"rows": [_fail(name, e)]}
    sys.stdout.flush()
    print(ROW_MARK + json.dumps(payload), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


