"""The baselines' worker process under torchrun: the padded Trainer, TRL SFTTrainer, or the same-job A/B diagnostic.

    torchrun --nproc_per_node=2 bench/train_worker.py SPEC.json     (bench_train.py starts it)

zerotune itself runs through its own CLI; every contender's workers get the same measurement probe
(bench/probe/train_probe.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from train_setup import BENCH, CHAT, WORK, ZT_OUT, recipe, trl_chat_template


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from zerotune import batch as batchmod
    from zerotune import hardware
    from zerotune.data.cache import load_tokenizer
    from zerotune.train.args import training_kwargs

    spec = json.loads(Path(spec_path).read_text())
    kind = spec["kind"]
    r = recipe(spec["overrides"])
    bp = batchmod.derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, r.train.cpu_procs)
    choice = hardware.choose(hardware.detect(), r.train.precision, r.train.attention, r.train.liger)
    # zerotune's own TrainingArguments fields; what differs is only what makes each contender what it is: its
    # micro-batch (documents, not packed rows), a plain user's defaults (random sampling, unused columns
    # dropped), and no checkpoints
    common = {**training_kwargs(r, bp, choice, False, spec["steps"]), "output_dir": str(WORK / f"ckpt-{kind}"),
              "per_device_train_batch_size": spec["micro_batch"], "save_strategy": "no", "report_to": [],
              "remove_unused_columns": True, "train_sampling_strategy": "random"}
    if kind == "ab":
        common.update(per_device_train_batch_size=1, gradient_accumulation_steps=1,
                      remove_unused_columns=False, train_sampling_strategy="sequential")
    if kind in ("trainer_padded", "ab"):
        args = TrainingArguments(**common)  # before the model: ZeRO-3 shards at load time
    else:
        from trl import SFTConfig
        args = SFTConfig(**common, max_length=spec["seq_len"], packing=kind == "trl_packing",
                         assistant_only_loss=True, chat_template_path=trl_chat_template())
        # (bf16 comes from training_kwargs, as for zerotune: SFTConfig's own default would be bf16 on)
    import deepspeed
    # As in zerotune (and NOTES.md): under use_cpu=True the Trainer does not set up deepspeed.comm, so
    # zero.Init would see world size 1 and reject the batch config.
    deepspeed.init_distributed(dist_backend="gloo")
    tok = load_tokenizer(r)  # the same tokenizer and pad id as zerotune (padding is label-masked either way)
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False

    sys.path.insert(0, str(BENCH / "probe"))
    from train_probe import install

    install(spec["out"])  # the same probe zerotune's workers get through bench/probe/sitecustomize.py

    if kind == "ab":
        return ab_worker(spec, args, model, tok)
    if kind == "trainer_padded":
        ds = load_from_disk(spec["tokenized"])

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          data_collator=DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100))
    else:
        from trl import SFTTrainer

        with open(CHAT) as f:
            ds = Dataset.from_list([json.loads(x) for _, x in zip(range(spec["conversations"]), f)])
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    dist.barrier()


def ab_worker(spec: dict, args, model, tok) -> None:
    """Diagnostic, not a contender: ONE DeepSpeed job whose optimizer steps alternate between zerotune's packed
    rows (one per rank) and the padded Trainer's micro-batches (2 documents per rank), so load from other jobs hits
    both alike. Gives the wall and CPU time per processed token of each batch shape under ZeRO-3."""
    import torch
    import torch.distributed as dist
    from datasets import load_from_disk
    from transformers import Trainer, TrainerCallback

    packed, padded = load_from_disk(str(ZT_OUT / "data" / "train")), load_from_disk(spec["tokenized"])
    b, pad_id = spec["micro_batch"], tok.pad_token_id

    def pk(i):
        return {k: torch.tensor([packed[i][k]]) for k in ("input_ids", "labels", "position_ids")}

    def pd(i):
        rows = [padded[b * i + k] for k in range(b)]
        n = max(len(r["input_ids"]) for r in rows)
        return {"input_ids": torch.tensor([r["input_ids"] + [pad_id] * (n - len(r["input_ids"])) for r in rows]),
                "labels": torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows]),
                "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"]))
                                                for r in rows])}

    # items 2j and 2j+1 go to ranks 0 and 1 at step j: both ranks see the same shape in a step
    items = [pk(2 * j + r) if j % 2 == 0 else pd(2 * j + r) for j in range(args.max_steps) for r in range(2)]
    log, tokens = [], []

    class Steps(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, a, state, control, **kw):
            log.append((time.perf_counter() - self.t0, time.process_time() - self.c0, tokens[-1]))

    class T(Trainer):
        def compute_loss(self, model, inputs, *a, **kw):
            tokens.append(inputs["input_ids"].numel())
            return super().compute_loss(model, inputs, *a, **kw)

    T(model=model, args=args, train_dataset=items, data_collator=lambda rows: rows[0], callbacks=[Steps()]).train()
    out = {"packed": [], "padded": []}
    for j, (dt, dcpu, n) in enumerate(log):
        s = torch.tensor([float(n), dcpu])
        dist.all_reduce(s)
        if j >= 2:  # one warm-up step of each shape
            out["packed" if j % 2 == 0 else "padded"].append(
                {"step_time_s": dt, "cpu_s": float(s[1]), "processed_tokens": int(s[0])})
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    worker(sys.argv[1])
