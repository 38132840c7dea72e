"""Diagnostic, not part of `make bench`: where a training step's CPU time goes, per rank (bench/README.md,
"Where training's CPU time goes"). On PYTHONPATH for one `python -m zerotune finetune` run; active only in the
torchrun workers (RANK set) and only when ZT_BREAKDOWN_DIR names an output folder:

    ZT_BREAKDOWN_DIR=/tmp/bd ZT_BREAKDOWN_TIMERS=1 PYTHONPATH=bench/probe/breakdown \
        .venv/bin/python -m zerotune finetune RECIPE output_dir=/tmp/bd-run train.max_steps=4

Writes steps-rank<R>.jsonl: per optimizer step the wall and CPU time of the process and of its main thread, and
`parts`: {name: [wall s, main-thread CPU s, calls]} with *exclusive* times (a timed call inside another, such as
the checkpoint recompute inside a linear layer's backward, is charged to itself only). Without
ZT_BREAKDOWN_TIMERS only DeepSpeed's forward/backward/step are timed. ZT_BREAKDOWN_PROFILE=2,3 adds a
torch.profiler op table (ops-step<N>-rank<R>.json) for those steps, or cProfile stats with ZT_BREAKDOWN_MODE=cprofile
(how the slow LoRA step 2 was found). ZT_BREAKDOWN_LORA_LEAF=1 marks peft's LoRA layers as ZeRO-3 leaf modules
(an experiment, see the README). CPU process time includes threads other than the main one (gloo's).
"""
import os

if os.environ.get("ZT_BREAKDOWN_DIR") and "RANK" in os.environ:
    import json
    import time

    OUT = os.environ["ZT_BREAKDOWN_DIR"]
    PROFILE = {int(s) for s in os.environ.get("ZT_BREAKDOWN_PROFILE", "").split(",") if s}
    RANK = int(os.environ["RANK"])
    acc = {}

    def _add(k, dw, dc):
        a = acc.setdefault(k, [0.0, 0.0, 0])
        a[0] += dw; a[1] += dc; a[2] += 1

    import threading
    _tl = threading.local()

    def _enter():
        st = getattr(_tl, "st", None)
        if st is None:
            st = _tl.st = []
        st.append([time.perf_counter(), time.thread_time(), 0.0, 0.0])

    def _exit(key):
        # exclusive times: a nested timed call (the recompute inside a linear backward) is charged to itself only
        st = _tl.st
        t, c, cw, cc = st.pop()
        dw, dc = time.perf_counter() - t, time.thread_time() - c
        _add(key, dw - cw, dc - cc)
        if st:
            st[-1][2] += dw
            st[-1][3] += dc

    def _wrap(cls, name, key):
        f = getattr(cls, name)

        def w(self, *a, **kw):
            _enter()
            try:
                return f(self, *a, **kw)
            finally:
                _exit(key)
        setattr(cls, name, w)

    import torch
    import torch.optim.optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    _wrap(DeepSpeedEngine, "forward", "ds_forward")
    _wrap(DeepSpeedEngine, "backward", "ds_backward")
    _wrap(DeepSpeedEngine, "step", "ds_step")
    _opt = {}

    def pre(opt, a, kw):
        _opt["t"], _opt["c"] = time.perf_counter(), time.thread_time()

    def post(opt, a, kw):
        _add("torch_optim_step", time.perf_counter() - _opt["t"], time.thread_time() - _opt["c"])
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)

    from transformers import Trainer, TrainerCallback

    class Perf(TrainerCallback):
        t0 = c0 = None
        prof = None

        def on_step_begin(self, args, state, control, **kw):
            if self.t0 is None:
                self.t0, self.c0, self.h0 = time.perf_counter(), time.process_time(), time.thread_time()
            step = state.global_step + 1
            if step in PROFILE:
                if os.environ.get("ZT_BREAKDOWN_MODE") == "cprofile":
                    import cProfile
                    self.cprof = cProfile.Profile()
                    self.cprof.enable()
                else:
                    self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                       record_shapes=False, with_stack=False)
                    self.prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            now, cpu, th = time.perf_counter(), time.process_time(), time.thread_time()
            if getattr(self, "cprof", None) is not None:
                self.cprof.disable()
                self.cprof.dump_stats(f"{OUT}/cprof-step{state.global_step}-rank{RANK}.pstats")
                self.cprof = None
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                rows = [{"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total,
                         "cpu_us": e.cpu_time_total} for e in self.prof.key_averages()]
                with open(f"{OUT}/ops-step{state.global_step}-rank{RANK}.json", "w") as f:
                    json.dump(rows, f)
                self.prof = None
            row = {"step": state.global_step, "rank": RANK, "wall": now - self.t0, "cpu": cpu - self.c0, "main_thread_cpu": th - self.h0,
                   "parts": {k: [round(v[0], 3), round(v[1], 3), v[2]] for k, v in acc.items()}}
            acc.clear()
            with open(f"{OUT}/steps-rank{RANK}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            self.t0, self.c0, self.h0 = time.perf_counter(), time.process_time(), time.thread_time()

    init = Trainer.__init__

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        self.add_callback(Perf())
    Trainer.__init__ = __init__

if os.environ.get("ZT_BREAKDOWN_LORA_LEAF") and "RANK" in os.environ:
    from zerotune import adapters as _pu
    _wrap0 = _pu.wrap

    def _leaf_wrap(model, r):
        model, t, n = _wrap0(model, r)
        from deepspeed.utils import set_z3_leaf_modules
        from peft.tuners.lora import LoraLayer
        mods = set_z3_leaf_modules(model, [LoraLayer])
        print(f"breakdown: {len(mods)} LoRA layers set as ZeRO-3 leaf modules", flush=True)
        return model, t, n
    _pu.wrap = _leaf_wrap

if os.environ.get("ZT_BREAKDOWN_TIMERS") and "RANK" in os.environ:
    import torch.nn.functional as _F
    from deepspeed.runtime.zero import linear as _lin
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as _PPC
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as _S3
    from torch.utils.data.dataloader import _BaseDataLoaderIter as _DLI

    _wrap(_PPC, "fetch_sub_module", "zero3_fetch (all-gather+wait)")
    _wrap(_PPC, "release_sub_module", "zero3_release")
    _wrap(_S3, "reduce_ready_partitions_and_remove_grads", "zero3_grad_hook (reduce-scatter)")
    _wrap(_S3, "independent_gradient_partition_epilogue", "zero3_grad_epilogue")
    _wrap(_DLI, "__next__", "data (next batch)")

    def _wrap_static(cls, name, key):
        f = getattr(cls, name)

        def w(*a, **kw):
            _enter()
            try:
                return f(*a, **kw)
            finally:
                _exit(key)
        setattr(cls, name, staticmethod(w))
    _wrap_static(_lin.LinearFunctionForZeroStage3, "forward", "linear fwd (matmul)")
    _wrap_static(_lin.LinearFunctionForZeroStage3, "backward", "linear bwd (2 matmuls)")
    _sdpa = _F.scaled_dot_product_attention

    def _sdpa_w(*a, **kw):
        _enter()
        try:
            return _sdpa(*a, **kw)
        finally:
            _exit("sdpa fwd")
    _F.scaled_dot_product_attention = _sdpa_w
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM
    # not a class-level wrapper: GradientCheckpointingLayer checkpoints only when type(self).forward is its own
    # wrapper (transformers modeling_layers.py), so replace the original forward inside that wrapper's closure
    _fwc = LlamaDecoderLayer.forward
    _cell = _fwc.__closure__[_fwc.__code__.co_freevars.index("forward")]
    _orig_layer_fwd = _cell.cell_contents

    def _layer_fwd(self, *a, **kw):
        _enter()
        try:
            return _orig_layer_fwd(self, *a, **kw)
        finally:
            _exit("decoder layer fwd excl. linears/sdpa (norms, rope, SwiGLU, residual, hooks)")
    _cell.cell_contents = _layer_fwd
    _wrap(LlamaForCausalLM, "forward", "model fwd rest (embedding, final norm, loss)")
