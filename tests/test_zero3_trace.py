"""Whether ZeRO-3 still prefetches its gathers in a GRPO micro-step, measured under real DeepSpeed on 2 CPU ranks: the
time model's Job.prefetch (planner/time.py) says the rollouts gathered once take it away.

Method. This file is its own torchrun worker (tests/zero3_cpu.py launch). The tiny Llama of the other ZeRO-3
measurements trains 4 optimizer steps (GA 1) through the HF Trainer with the shipped configs/deepspeed/zero3.json.
Before each step a callback generates 4 tokens for 2 prompts, as GRPO's rollouts do (rl/rollout.py), one of three
ways: not at all (SFT), through ZeRO-3's hooks with synced_gpus (the per-token gathers: rollouts that do not fit
gathered), or inside gathering.whole_model's DeepSpeed unwrap_model_for_generation (gathered once). After each step
it reads the parameter coordinator's trace mode: COMPLETE means the step's forward and backward fetched along a
recorded trace, i.e. prefetched (deepspeed 0.19.8 partitioned_param_coordinator.py fetch_sub_module); RECORD means
they recorded it again and fetched each module only when it was reached.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from zero3_cpu import MODEL, WORLD, launch

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def _worker(mode: str, out: Path) -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.zero import unwrap_model_for_generation
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    from zerotune.ds_config import loss_scale

    rank = int(os.environ["RANK"])
    cfg = json.loads((REPO / "configs" / "deepspeed" / "zero3.json").read_text())
    cfg["fp16"]["initial_scale_power"], cfg["fp16"]["loss_scale_window"] = loss_scale(1, 1)
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                             max_steps=STEPS, learning_rate=1e-3, bf16=True, use_cpu=True, deepspeed=cfg,
                             save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=STEPS,
                             remove_unused_columns=False, dataloader_num_workers=0, seed=0,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**MODEL), dtype=torch.bfloat16)  # zero.Init: sharded
    g = torch.Generator().manual_seed(rank)
    rows = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(0, MODEL["vocab_size"], (64,), generator=g).tolist() for _ in range(STEPS * WORLD))]
    prompts = torch.randint(0, MODEL["vocab_size"], (2, 8), generator=g)
    gen = GenerationConfig(do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0, eos_token_id=None)
    modes: list[str] = []

    def coordinator():
        return trainer.model_wrapped.optimizer.parameter_offload.get_param_coordinator()

    def trace_mode() -> str:
        c = coordinator()
        return "complete" if c.is_complete_trace() else "record" if c.is_record_trace() else "invalid"

    def after_forward(module, inputs, output):  # the training forward's end: how it fetched
        if module.training:
            modes.append(["forward", trace_mode()])

    class Rollouts(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if mode == "none":
                return
            net = trainer.model_wrapped.module
            net.eval()
            with torch.no_grad():
                if mode == "per_token":
                    net.generate(input_ids=prompts, generation_config=gen, synced_gpus=True)
                else:
                    with unwrap_model_for_generation(trainer.model_wrapped):
                        net.generate(input_ids=prompts, generation_config=gen)
            net.train()

        def on_step_end(self, *a, **k):  # after the backward (and the optimizer step, which fetches nothing)
            modes.append(["step", trace_mode()])

    model.register_forward_hook(after_forward)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Rollouts()])
    trainer.train()
    (out / f"trace_{mode}_rank{rank}.json").write_text(json.dumps(modes))


@pytest.mark.integration
def test_grpos_rollouts_leave_zero3_without_prefetch():
    """SFT records the trace in step 1 and prefetches from step 2 on (the trace stays COMPLETE through forward and
    backward). GRPO's rollouts take it away (the plan's Job.prefetch):
    - through ZeRO-3's hooks (per-token gathers), generate() records its own trace, a forward's; the training
      forward matches it (prefetched) and the backward runs past its end, which invalidates it: the backward fetches
      each module when it is reached;
    - gathered once, unwrap_model_for_generation re-registers the hooks (parameter_offload.py:337-343), which
      invalidates the trace: the forward records it again and nothing is prefetched."""
    seen = {}
    for mode in ("none", "per_token", "gathered"):
        out = Path(tempfile.mkdtemp(prefix=f"trace_{mode}_"))
        launch(__file__, mode, out)
        seen[mode] = [json.loads((out / f"trace_{mode}_rank{r}.json").read_text()) for r in range(WORLD)]
        shutil.rmtree(out, ignore_errors=True)
    steady = {mode: [m[2:] for m in ranks] for mode, ranks in seen.items()}  # steps 2..4: forward, step end
    want = {"none": ["forward", "complete", "step", "complete"], "per_token": ["forward", "complete", "step", "invalid"],
            "gathered": ["forward", "record", "step", "record"]}
    for mode, ranks in steady.items():
        for modes in ranks:
            assert [x for pair in modes for x in pair] == want[mode] * (STEPS - 1), (mode, seen[mode])


def test_the_plan_charges_grpo_steps_their_gathers_without_prefetch():
    """The plan's GRPO step: a LoRA step (its rollouts gathered once on one node) and a full fine-tune on one node (per
    token) and on two (gathered once): no gather overlaps in the forward when gathered once, none in the backward
    either way (test_grpos_rollouts_leave_zero3_without_prefetch); SFT's are overlapped."""
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan

    for name, nodes, forward_hidden in (("llama8b_grpo_lora_zero3", 1, False), ("llama8b_grpo_zero3", 1, True),
                                        ("llama8b_grpo_zero3", 2, False)):
        p = compute_plan(load_recipe(name), nodes=nodes)
        t, pm = p.time, p.time.per_micro_step
        assert p.phases.rollout.gather_once != forward_hidden and t.prefetch == ("forward" if forward_hidden else "none")
        assert pm.exposed_s >= pm.backward_gather_s + (0 if forward_hidden else pm.forward_gather_s) - 1e-9, name
    assert compute_plan(load_recipe("llama8b_zero3")).time.prefetch == "all"


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
