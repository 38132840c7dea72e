"""The collectives ZeRO-3 issues per micro-step, counted under real DeepSpeed on 2 CPU ranks, against the number
the time model charges NCCL's per-collective latency for (planner/time.py: per gathered module a forward
gather, a backward gather and, in a full fine-tune, a gradient reduce-scatter).

Method. This file is its own torchrun worker (launched by tests/zero3_cpu.py's launch, as zerotune's CPU training
is). The tiny untied Llama that tests/test_phase_memory_zero3.py measures too (zero3_cpu.MODEL: hidden 256, 4 layers,
30 modules above the persistence threshold: 7 projections per layer, the embedding, the lm_head) trains 3 optimizer steps through the HF Trainer
with the shipped configs/deepspeed/zero3.json, gradient checkpointing (non-reentrant, as the worker sets it) and
GA 2. DeepSpeed's own comms logger (config "comms_logger", prof_all) counts every collective by name; a callback
reads the counts at each micro-step boundary. The first micro-step of steps 2 and 3 is the steady state: the trace
is complete (step 1 records it) and no optimizer step falls inside it.

Scaled to the 8B regime: stage3_max_reuse_distance and stage3_max_live_parameters are 1e9 in the shipped config,
1/8 of Llama-3.1-8B's parameters, so at 8B most of the model is released after its forward use and gathered again
for the recompute and backward. At this tiny model's 2.9M parameters 1e9 keeps everything, and the backward would
gather nothing (measured: 26 gathers per micro-step). The worker sets both to the same 1/8 of the tiny model.

Findings (deepspeed 0.19.8, transformers 5.23): per steady micro-step 67 all-gathers and 35 reduce-scatters = 102
collectives for 30 gathered modules (the model charges 60 + 30 = 90, 12% fewer). The gathers depend on the limits:
with the shipped 1e9 (nothing released at this size) the forward alone gathers, 26 times = 4 layers x 6 + 2 (the
prefetch takes k and v together: stage3_prefetch_bucket_size "auto" = 0.9 hidden^2); with the reuse distance alone at
1/8, 38; with the live limit at 1/8 too, 67, more than two per module, because each prefetch takes at most what the
limit leaves (partitioned_param_coordinator.py fetch_sub_module: min(max_live - available, prefetch bucket)). More
reduce-scatters than modules: the gradient bucket (reduce_bucket_size "auto" = hidden^2) flushes before a gradient
that would overflow it (stage3.py), so a norm's small gradient next to a projection of hidden^2 parameters goes
alone (8 per layer for 7 projections). The 9 persistent norms are gathered again once after each optimizer step
(per step, not per micro-step).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from zero3_cpu import MODEL, WORLD, launch  # the tiny Llama and the 2-rank CPU torchrun, shared with test_phase_memory_zero3

REPO = Path(__file__).resolve().parents[1]
STEPS, GA = 3, 2
TOL = 0.25  # measured collectives per micro-step within +-25% of the model's count


def _worker(out: Path) -> None:
    import deepspeed
    import torch
    from deepspeed.comm import comm as ds_comm
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from zerotune.ds_config import loss_scale

    rank = int(os.environ["RANK"])
    cfg = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())
    cfg["fp16"]["initial_scale_power"], cfg["fp16"]["loss_scale_window"] = loss_scale(1, 1)
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**MODEL)).parameters())
    eighth = n // 8  # what 1e9 is to Llama-3.1-8B's 8.03e9 parameters
    cfg["zero_optimization"].update(stage3_max_reuse_distance=eighth, stage3_max_live_parameters=eighth)
    cfg["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=1, gradient_accumulation_steps=GA,
                             max_steps=STEPS, learning_rate=1e-3, bf16=True, use_cpu=True, deepspeed=cfg,
                             save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=STEPS,
                             remove_unused_columns=False, dataloader_num_workers=0, seed=0,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    deepspeed.init_distributed(dist_backend="gloo")  # before zero.Init (train/worker.py setup)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**MODEL), dtype=torch.bfloat16)  # zero.Init: sharded
    assert all(hasattr(p, "ds_numel") for p in model.parameters()), "not built under zero.Init"
    g = torch.Generator().manual_seed(rank)
    rows = [{"input_ids": ids, "labels": ids} for ids in  # the sampler splits them over the 2 ranks
            (torch.randint(0, MODEL["vocab_size"], (64,), generator=g).tolist() for _ in range(STEPS * GA * 2))]
    marks: list[tuple[str, dict]] = []

    def counts() -> dict:
        return {op: sum(v[0] for v in by_size.values()) for op, by_size in ds_comm.comms_logger.comms_dict.items()}

    class Count(TrainerCallback):
        def on_substep_end(self, *a, **k):  # a micro-step that ends without the optimizer step
            marks.append(("micro", counts()))

        def on_step_end(self, *a, **k):
            marks.append(("step", counts()))

    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Count()])
    marks.append(("start", counts()))
    trainer.train()
    (out / f"collectives_rank{rank}.json").write_text(json.dumps({"params": n, "marks": marks}))


pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3_collectives")
    launch(__file__, "collectives", out)
    return [json.loads((out / f"collectives_rank{r}.json").read_text()) for r in range(WORLD)]


def _deltas(marks: list) -> list[tuple[str, dict]]:
    out, prev = [], {}
    for kind, c in marks:
        out.append((kind, {op: c[op] - prev.get(op, 0) for op in c if c[op] - prev.get(op, 0)}))
        prev = c
    return out


def test_collectives_per_micro_step_are_what_the_latency_term_charges(counted, tmp_path):
    from transformers import LlamaConfig

    from zerotune.planner.memory import shape_of

    LlamaConfig(**MODEL).save_pretrained(tmp_path)
    zero = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
    modules = len(shape_of(str(tmp_path)).zero3_modules(zero)[0])  # the shipped config, as planned
    assert modules == 4 * 7 + 2  # the projections, the embedding, the lm_head; the norms stay resident
    charged = 3 * modules
    for rank in counted:
        steady = [d for kind, d in _deltas(rank["marks"])[1:] if kind == "micro"][1:]  # steps 2..STEPS
        assert len(steady) == STEPS - 1
        assert all(d == steady[0] for d in steady), steady  # the same collectives every steady micro-step
        d = steady[0]
        gathers, scatters = d.get("all_gather_into_tensor", 0), d.get("reduce_scatter_tensor", 0)
        assert set(d) <= {"all_gather_into_tensor", "reduce_scatter_tensor"}, d  # nothing else per micro-step
        # each part on its own, not only their sum: two gathers and one reduce-scatter per module
        assert abs(gathers / (2 * modules) - 1) <= TOL and abs(scatters / modules - 1) <= TOL, (d, modules)
        print(f"steady micro-step: {gathers} all-gathers + {scatters} reduce-scatters for {modules} modules "
              f"(the time model charges {charged})")
        assert abs((gathers + scatters) / charged - 1) <= TOL, (d, charged)


if __name__ == "__main__":  # torchrun runs this file from tests/, where zero3_cpu imports
    _worker(Path(sys.argv[2]))
