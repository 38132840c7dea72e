"""Global batch in tokens -> gradient accumulation, derived, never stated twice.

The recipe states the global batch in tokens, the micro-batch and seq_len; the
launcher states the world size. Gradient accumulation is what makes them meet,
and must divide exactly.
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

    @property
    def tokens_per_micro_step(self) -> int:
        return self.seq_len * self.micro_batch_size * self.world_size

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
        return (f"global batch {self.global_batch_tokens:,} tokens = seq_len {self.seq_len:,} x micro-batch "
                f"{self.micro_batch_size} x world {self.world_size} x grad-accum {self.grad_accum} "
                f"({self.sequences_per_step:,} sequences per optimizer step)")


def grad_accum(global_batch_tokens: int, seq_len: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step: the one formula. Where the batch does not divide exactly (derive refuses
    it; the planner still sizes it), the next whole number."""
    return max(1, -(-global_batch_tokens // (seq_len * micro_batch_size * world_size)))


def derive(global_batch_tokens: int, seq_len: int, micro_batch_size: int, world_size: int) -> BatchPlan:
    per = seq_len * micro_batch_size * world_size
    if global_batch_tokens % per:
        lo = max(1, global_batch_tokens // per)
        hi = lo + 1
        raise BatchError(
            f"train.global_batch_tokens={global_batch_tokens:,} is not a multiple of seq_len x micro-batch x world "
            f"= {seq_len} x {micro_batch_size} x {world_size} = {per:,}. Nearest valid: {lo * per:,} "
            f"(grad-accum {lo}) or {hi * per:,} (grad-accum {hi}).")
    return BatchPlan(global_batch_tokens, seq_len, micro_batch_size, world_size,
                     grad_accum(global_batch_tokens, seq_len, micro_batch_size, world_size))
