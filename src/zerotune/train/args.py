"""The recipe as the Trainer's arguments, batches and step count: shared by the worker and bench/bench_train.py."""

from __future__ import annotations

from .. import batch as batchmod
from .. import ds_config, hardware
from ..config import Recipe
from ..errors import UserError
from ..layout import layout
from .sequence_parallel import parallelism_config


def training_kwargs(r: Recipe, bp: batchmod.BatchPlan, choice: hardware.Choice, on_gpu: bool, max_steps: int,
                    load_universal: bool = False, label_tokens_per_row: float | None = None) -> dict:
    """The recipe as TrainingArguments fields; bench/bench_train.py builds its Trainer and TRL baselines from
    the same dict, so every contender trains with the same hyper-parameters. load_universal: resuming from a
    checkpoint written at another world size (reshard.py). label_tokens_per_row: the prepared data's, for the fp16
    loss scale of a preference objective (ds_config.micro_step_weight)."""
    return dict(
        output_dir=str(layout(r).checkpoints),
        per_device_train_batch_size=r.train.micro_batch_size,
        gradient_accumulation_steps=bp.grad_accum,
        max_steps=max_steps,
        learning_rate=r.train.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": r.train.min_lr_ratio},
        warmup_steps=r.train.warmup_ratio,  # transformers 5: a value below 1 is a fraction of the total steps
        weight_decay=r.train.weight_decay,
        adam_beta2=r.train.adam_beta2,
        max_grad_norm=r.train.max_grad_norm,
        fp16=choice.precision == "fp16",
        bf16=choice.precision == "bf16",
        activation_checkpointing=r.train.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        # the fp16 loss scale from the objective's weight per micro-step and the run length
        deepspeed=ds_config.build(r, bp, max_steps, load_universal, label_tokens_per_row),
        use_cpu=not on_gpu,
        logging_steps=r.train.logging_steps,
        logging_nan_inf_filter=False,  # a NaN must be seen, not averaged away
        save_strategy="steps" if r.train.save_steps > 0 else "no",
        save_steps=r.train.save_steps if r.train.save_steps > 0 else 500,
        save_total_limit=None,  # CommitCheckpoints rotates, after a commit: HF deletes before the new one is good
        report_to=[] if r.train.report_to == "none" else [r.train.report_to],
        run_name=r.name,
        seed=r.train.seed,
        data_seed=r.train.seed,
        remove_unused_columns=False,
        # unpacked: batch documents of similar length so padding stays small (packed rows are all seq_len)
        train_sampling_strategy="group_by_length" if batchmod.length_grouped(r) else "random",
        dataloader_num_workers=0,
        disable_tqdm=True,
        average_tokens_across_devices=True,
        ddp_timeout=DDP_TIMEOUT_S,
        # train.sequence_parallel > 1: DeepSpeed's Ulysses over the chosen attention (train/sequence_parallel.py)
        parallelism_config=parallelism_config(r.train.sequence_parallel, choice.attention),
    )


# Collectives wait this long for a rank that is still working alone (rank 0 writing what the others then read) before
# failing the job; DeepSpeed's own default is 10 minutes (deepspeed/constants.py default_pg_timeout), and the process
# group is made by deepspeed.init_distributed (worker.py), not the Trainer, so both are given this.
DDP_TIMEOUT_S = 3600


def training_arguments(r: Recipe, bp: batchmod.BatchPlan, choice: hardware.Choice, on_gpu: bool, max_steps: int,
                       load_universal: bool = False, label_tokens_per_row: float | None = None):
    from transformers import TrainingArguments

    return TrainingArguments(**training_kwargs(r, bp, choice, on_gpu, max_steps, load_universal,
                                               label_tokens_per_row))


def total_steps(n_sequences: int, bp: batchmod.BatchPlan, r: Recipe) -> int:
    steps = bp.total_steps(n_sequences, r.train.max_steps, r.train.epochs)
    if steps == 0 or (r.train.max_steps <= 0 and n_sequences < bp.sequences_per_step):
        raise UserError(f"the prepared data has {n_sequences} sequences, fewer than one optimizer step "
                         f"({bp.sequences_per_step}); lower train.global_batch_tokens or add data.")
    return steps


def collate_packed(rows):
    """Packed rows are all seq_len long: no padding, position_ids restart at each document (block-causal)."""
    import torch

    return {k: torch.tensor([row[k] for row in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}


def make_collate_padded(pad_id: int, sequence_parallel: int = 1):
    """Right-padded micro-batches. Under sequence parallelism the width is a multiple of N (each rank takes an equal
    slice) and the rows carry position_ids (DeepSpeed's Ulysses reads positions, not the mask, which it drops: right
    padding keeps every real token's causal view free of pads)."""
    import torch

    def collate(rows):
        n = max(len(row["input_ids"]) for row in rows)
        n = -(-n // sequence_parallel) * sequence_parallel
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        for row in rows:
            pad = n - len(row["input_ids"])
            out["input_ids"].append(row["input_ids"] + [pad_id] * pad)
            out["labels"].append(row["labels"] + [-100] * pad)
            out["attention_mask"].append([1] * len(row["input_ids"]) + [0] * pad)
        if sequence_parallel > 1:
            out["position_ids"] = [list(range(n))] * len(rows)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}

    return collate
