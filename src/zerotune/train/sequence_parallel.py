"""Sequence parallelism (train.sequence_parallel = N): one row of seq_len tokens trained by N ranks, each holding
seq_len / N of its tokens, so a 32K-token row fits V100s that one 16K row fills
(docs/training.md#long-rows-sequence-parallelism).

What rides on the pinned stack (ALST: DeepSpeed 0.19.8 runtime/sequence_parallel/ulysses_sp.py, accelerate 1.15,
transformers 5.23), and how zerotune's own pieces meet it, phase by phase:

  training step  accelerate's ParallelismConfig(sp_backend="deepspeed", sp_size=N) (accelerator.py ~2395-2445) makes
                 DeepSpeed's sequence-parallel groups (N consecutive ranks: inside one node, config.py checks N
                 divides its GPUs) and hands them to deepspeed.initialize as `mpu`, so ZeRO-3 still partitions the
                 model over every rank and gradients still reduce over every rank. It registers UlyssesSPAttentionHF
                 over the model's attention: per layer an all-to-all turns each rank's (seq/N tokens, all heads) into
                 (all tokens, heads/N), calls the core attention, and turns the output back. The core is zerotune's
                 `sdpa_docs` (attention.py): before calling it the wrapper all-gathers position_ids over the group
                 (ulysses_sp.py ~282-296), which are exactly what sdpa_docs reads the documents from, so every
                 document of the packed row is attended whole on every rank, whatever shard boundary crosses it.
                 The wrapper drops any dense mask: right-padded unpacked rows stay correct (no real token sees a
                 pad under the causal path), transformers' packed mask for `sdpa` would not (config.py refuses it).
  data           the Trainer wraps the train loader in UlyssesSPDataLoaderAdapter: every rank still loads its own
                 rows (the sampler spans all ranks), the group all-gathers its N rows and each rank takes its slice
                 of each, with the labels shifted before slicing (`shift_labels`), so no label is lost at a shard
                 boundary. N micro-batches per row loaded: batch.py counts GA over world / N.
  loss           transformers' SP loss (integrations/deepspeed.py deepspeed_sp_compute_loss) averages each
                 micro-batch over its own label tokens. zerotune's loss divides by the label tokens of the whole
                 optimizer step on all ranks (average_tokens_across_devices), which no micro-batch's mean equals when
                 rows carry different numbers of labels; `SequenceParallelLoss` below keeps that normalisation:
                 each rank's summed token losses over the step's global label count, times the world size that
                 DeepSpeed's gradient average divides by. This is the one piece written here rather than taken.
  validation,    disable_in_eval (accelerate passes it): in eval mode the wrapper calls sdpa_docs on the whole row
  samples        unsharded, so validation's loss (train/validation.py) and generate() run as without SP, at the
                 full row per GPU (the plan sizes them there: planner/phases.py).
  checkpoint     nothing in a checkpoint depends on N: ZeRO-3 partitions by world size. A resume at another N on
                 the same world loads it as it is, and each rank has consumed the same rows per step at any N (its
                 own rows, GA x N / N of them); another world size converts it (reshard.py).
  DPO            refused (config.py): the pair loss sums each completion's log-probability over its whole row.
"""

from __future__ import annotations

from transformers import Trainer

from .. import attention


def parallelism_config(n: int, attn: str):
    """accelerate's config for N-way Ulysses over the model's attention `attn` (None for N = 1).

    accelerate 1.15 checks sp_attn_implementation against its own list (flash_attention_2/3, sdpa, hub flash
    kernels; utils/dataclasses.py DeepSpeedSequenceParallelConfig.__post_init__) before DeepSpeed ever sees it;
    DeepSpeed accepts any name registered in transformers' ALL_ATTENTION_FUNCTIONS (ulysses_sp.py
    register_with_transformers), where sdpa_docs is (attention.register). So the name is set after that check."""
    if n == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True)  # unpacked rows vary in length
    handler.sp_attn_implementation = attention.load_name(attn)
    return ParallelismConfig(sp_backend="deepspeed", sp_size=n, sp_handler=handler)


def shard_loss(model, inputs: dict, num_items_in_batch, world: int):
    """One rank's loss on its slice of a row under sequence parallelism: its token losses summed over the optimizer
    step's label tokens on every rank (`num_items_in_batch`), times the world size DeepSpeed's gradient average
    divides by, so the gradients sum to those of the unsplit rows. Returns the model's output, its loss set."""
    # labels only tells the model's forward to compute a loss: given shift_labels, HF's ForCausalLMLoss and Liger's
    # fused loss both take those as they are (no second shift)
    out = model(**inputs, labels=inputs["shift_labels"], num_items_in_batch=num_items_in_batch)
    out.loss = out.loss * world
    return out


class SequenceParallelTrainer(Trainer):
    """The worker's Trainer under sequence parallelism: the loss divides by the optimizer step's label tokens on all
    ranks, as it does without SP (see the module docstring), so GA needs no second division."""
    loss_is_scaled_for_ga = True

    def _get_num_items_in_batch(self, batch_samples, device):
        # the adapter's micro-batches carry shifted labels only: this rank's slice of each row, disjoint across ranks
        n = sum((b["shift_labels"] != -100).sum() for b in batch_samples).to(device)
        return self.accelerator.gather(n.reshape(1)).sum()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        out = shard_loss(model, inputs, num_items_in_batch, self.accelerator.num_processes)
        return (out.loss, out) if return_outputs else out.loss
