"""The one measurement probe of bench/bench_train.py, installed identically in every contender's workers.

`install(path)` patches `transformers.Trainer.__init__` so that every Trainer (zerotune's, the plain one,
TRL's SFTTrainer) gets
- a counting wrapper around its `compute_loss`: per micro-batch, label tokens (labels != -100), real tokens
  (attention_mask; for packed or padding-free rows without a mask, everything but a trailing padding segment,
  recognised as a segment of one repeated id: the pad) and processed tokens (the input tensor);
- a callback that, per optimizer step, takes the wall time between consecutive step ends (the first step from its
  start: zerotune's metrics.jsonl definition) and the CPU time of the process (`time.process_time`, all threads),
  sums the counts and CPU times over ranks, takes the max RSS (ru_maxrss) over ranks, and lets rank 0 append one
  JSON line to `path`.
The cost is one reduction of a few integers per micro-batch and one all_reduce per step, the same for all.
"""

from __future__ import annotations

import json
import resource
import time

def _real_tokens(inputs) -> int:
    ids = inputs["input_ids"]
    if inputs.get("attention_mask") is not None:
        return int(inputs["attention_mask"].sum())
    real = ids.numel()
    if inputs.get("position_ids") is not None:
        for row_ids, pos in zip(ids, inputs["position_ids"]):
            start = int((pos == 0).nonzero().max())
            tail = row_ids[start:]
            # a padding segment repeats the pad id; a document never is one token repeated (any tokenizer)
            if len(tail) > 1 and bool((tail == tail[0]).all()):
                real -= len(tail)
    return real


def install(path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback

    counts = [0, 0, 0]  # label, real, processed tokens on this rank since the last step end

    class Probe(TrainerCallback):
        t0 = c0 = None

        def on_step_begin(self, args, state, control, **kw):
            if self.t0 is None:
                self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            now, cpu = time.perf_counter(), time.process_time()
            dt, dcpu, self.t0, self.c0 = now - self.t0, cpu - self.c0, now, cpu
            s = torch.tensor([*counts, dcpu], dtype=torch.float64)
            mem = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
            if dist.is_initialized():
                dist.all_reduce(s)
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            counts[:] = [0, 0, 0]
            if not dist.is_initialized() or dist.get_rank() == 0:
                with open(path, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "step_time_s": dt, "cpu_s": float(s[3]),
                                        "label_tokens": int(s[0]), "real_tokens": int(s[1]),
                                        "processed_tokens": int(s[2]),
                                        "peak_mem_gib_max_rank": mem.item() / 2**30}) + "\n")

    init = Trainer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        compute_loss = self.compute_loss  # bound: the subclass's own (SFTTrainer overrides it)

        def counting_compute_loss(model, inputs, *a, **kw):
            labels = inputs["labels"]
            counts[0] += int((labels != -100).sum())
            counts[1] += _real_tokens(inputs)
            counts[2] += inputs["input_ids"].numel()
            return compute_loss(model, inputs, *a, **kw)

        self.compute_loss = counting_compute_loss
        self.add_callback(Probe())

    Trainer.__init__ = __init__
