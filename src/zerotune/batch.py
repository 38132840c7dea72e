"""Global batch in tokens -> gradient accumulation, derived, never stated twice.

The recipe states the global batch in tokens, the micro-batch and seq_len; the
launcher states the world size. Gradient accumulation is what makes them meet,
and must divide exactly. A preference pair (preference.method: dpo) is one sample of
two rows, chosen and rejected, each up to seq_len: it counts 2 x seq_len tokens
(`rows`), the padded bound its micro-batch is planned at.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError


class BatchError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class BatchPlan:
    global_batch_tokens: int
    seq_len: int
    micro_batch_size: int
    world_size: int
    grad_accum: int
    rows: int = 1  # rows per sample: 2 for a preference pair (chosen + rejected); micro_batch_size counts samples

    @property
    def tokens_per_micro_step(self) -> int:
        return self.seq_len * self.rows * self.micro_batch_size * self.world_size

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.world_size * self.grad_accum

    def steps_per_epoch(self, n_sequences: int) -> int:
        """Optimizer steps the HF Trainer takes per pass over the prepared sequences: each rank's dataloader holds
        ceil(ceil(n / micro) / world) micro-batches (accelerate evens ranks out by repeating the first rows), and
        an epoch ends with a partial accumulation step when they don't divide by GA (transformers trainer.py,
        num_update_steps_per_epoch). Counted in sequences, not tokens: an unpacked row is one document, shorter
        than seq_len, so tokens / global batch would count far fewer steps than the Trainer takes."""
        per_rank = -(-(-(-n_sequences // self.micro_batch_size)) // self.world_size)
        return -(-per_rank // self.grad_accum)

    def total_steps(self, n_sequences: int, max_steps: int, epochs: float) -> int:
        """The run's optimizer steps, as the worker trains them and the plan books them (0: not one step of data)."""
        if max_steps > 0:
            return max_steps
        per_epoch = self.steps_per_epoch(n_sequences)
        return max(1, int(per_epoch * epochs)) if per_epoch else 0

    def record(self) -> dict:
        """The batch as a run writes it down (the commit marker, run.json): the world size is recorded on its own."""
        return {"global_batch_tokens": self.global_batch_tokens, "seq_len": self.seq_len,
                "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum}

    def describe(self) -> str:
        if self.rows == 2:
            return (f"global batch {self.global_batch_tokens:,} tokens = 2 rows (chosen, rejected) x seq_len "
                    f"{self.seq_len:,} x micro-batch {self.micro_batch_size} pairs x world {self.world_size} x "
                    f"grad-accum {self.grad_accum} ({self.sequences_per_step:,} pairs per optimizer step)")
        return (f"global batch {self.global_batch_tokens:,} tokens = seq_len {self.seq_len:,} x micro-batch "
                f"{self.micro_batch_size} x world {self.world_size} x grad-accum {self.grad_accum} "
                f"({self.sequences_per_step:,} sequences per optimizer step)")


def rows_per_sample(r) -> int:
    """2 for a recipe that trains on preference pairs (config.Recipe.pairs), else 1."""
    return 2 if r.pairs else 1


def length_grouped(r) -> bool:
    """Whether the Trainer batches by length: unpacked SFT rows are (less padding). Preference pairs are drawn at
    random: a length-grouped epoch's order depends on grad-accum (reshard.refuse_unresumable), so a resume at
    another world size could not keep it."""
    return not r.data.packing and not r.pairs


def grad_accum(global_batch_tokens: int, seq_len: int, micro_batch_size: int, world_size: int, rows: int = 1) -> int:
    """Micro-batches per optimizer step: the one formula. Where the batch does not divide exactly (derive refuses
    it; the planner still sizes it), the next whole number."""
    return max(1, -(-global_batch_tokens // (seq_len * rows * micro_batch_size * world_size)))


def derive(global_batch_tokens: int, seq_len: int, micro_batch_size: int, world_size: int,
           rows: int = 1) -> BatchPlan:
    per = seq_len * rows * micro_batch_size * world_size
    if global_batch_tokens % per:
        lo = max(1, global_batch_tokens // per)
        hi = lo + 1
        what = ("2 rows x seq_len x micro-batch (pairs) x world" if rows == 2 else "seq_len x micro-batch x world")
        factors = " x ".join(str(x) for x in ((2,) if rows == 2 else ()) + (seq_len, micro_batch_size, world_size))
        raise BatchError(
            f"train.global_batch_tokens={global_batch_tokens:,} is not a multiple of {what} "
            f"= {factors} = {per:,}. Nearest valid: {lo * per:,} "
            f"(grad-accum {lo}) or {hi * per:,} (grad-accum {hi}).")
    return BatchPlan(global_batch_tokens, seq_len, micro_batch_size, world_size,
                     grad_accum(global_batch_tokens, seq_len, micro_batch_size, world_size, rows), rows)
