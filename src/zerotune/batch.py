"""Global batch in tokens -> gradient accumulation, derived, never stated twice.

The recipe states the global batch in tokens, the micro-batch and seq_len; the
launcher states the world size. Gradient accumulation is what makes them meet,
and must divide exactly. With sequence parallelism (train.sequence_parallel = N) the N
ranks of a group share each row, so the ranks that see different rows are world / N
(`data_parallel`): every count of rows per step is over them. A preference pair (preference.method: dpo) is one sample of
two rows, chosen and rejected, each up to seq_len: it counts 2 x seq_len tokens
(`rows`), the padded bound its micro-batch is planned at. A GRPO prompt (rl.method: grpo) is one sample of G
rows, its G sampled completions (rl.group_size).
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
    rows: int = 1  # rows per sample: 2 for a preference pair (chosen + rejected), G for a GRPO prompt; micro_batch_size counts samples
    sequence_parallel: int = 1  # ranks sharing one row (DeepSpeed Ulysses)
    grpo: bool = False  # a sample is a prompt and its rows its G completions

    @property
    def data_parallel(self) -> int:
        """Ranks that see different rows."""
        return self.world_size // self.sequence_parallel

    @property
    def tokens_per_micro_step(self) -> int:
        return self.seq_len * self.rows * self.micro_batch_size * self.data_parallel

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.data_parallel * self.grad_accum

    def steps_per_epoch(self, n_sequences: int) -> int:
        """Optimizer steps the HF Trainer takes per pass over the prepared sequences: each rank's dataloader holds
        ceil(ceil(n / micro) / world) micro-batches (accelerate evens ranks out by repeating the first rows), and
        an epoch ends with a partial accumulation step when they don't divide by GA (transformers trainer.py,
        num_update_steps_per_epoch). Counted in sequences, not tokens: an unpacked row is one document, shorter
        than seq_len, so tokens / global batch would count far fewer steps than the Trainer takes. Under sequence
        parallelism every rank still loads its own rows, and DeepSpeed's Ulysses adapter shares each of its group's
        rows with all N of them: N micro-batches per row loaded (transformers trainer.py, len_dataloader x sp_size)."""
        per_rank = -(-(-(-n_sequences // self.micro_batch_size)) // self.world_size)
        return -(-per_rank * self.sequence_parallel // self.grad_accum)

    def total_steps(self, n_sequences: int, max_steps: int, epochs: float) -> int:
        """The run's optimizer steps, as the worker trains them and the plan books them (0: not one step of data)."""
        if max_steps > 0:
            return max_steps
        per_epoch = self.steps_per_epoch(n_sequences)
        return max(1, int(per_epoch * epochs)) if per_epoch else 0

    def record(self) -> dict:
        """The batch as a run writes it down (the commit marker, run.json): the world size is recorded on its own."""
        return {"global_batch_tokens": self.global_batch_tokens, "seq_len": self.seq_len,
                "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
                "sequence_parallel": self.sequence_parallel}

    def describe(self) -> str:
        ranks = (f"world {self.world_size}" if self.sequence_parallel == 1 else
                 f"data-parallel {self.data_parallel} (world {self.world_size} / sequence-parallel "
                 f"{self.sequence_parallel})")
        if self.grpo:
            return (f"global batch {self.global_batch_tokens:,} tokens = {self.rows} completions x seq_len "
                    f"{self.seq_len:,} x micro-batch {self.micro_batch_size} prompts x {ranks} x "
                    f"grad-accum {self.grad_accum} ({self.sequences_per_step:,} prompts, "
                    f"{self.sequences_per_step * self.rows:,} completions per optimizer step)")
        if self.rows == 2:
            return (f"global batch {self.global_batch_tokens:,} tokens = 2 rows (chosen, rejected) x seq_len "
                    f"{self.seq_len:,} x micro-batch {self.micro_batch_size} pairs x {ranks} x "
                    f"grad-accum {self.grad_accum} ({self.sequences_per_step:,} pairs per optimizer step)")
        return (f"global batch {self.global_batch_tokens:,} tokens = seq_len {self.seq_len:,} x micro-batch "
                f"{self.micro_batch_size} x {ranks} x grad-accum {self.grad_accum} "
                f"({self.sequences_per_step:,} sequences per optimizer step)")


def rows_per_sample(r) -> int:
    """2 for a recipe that trains on preference pairs (config.Recipe.pairs), G for GRPO (its completions per
    prompt), else 1."""
    return 2 if r.pairs else r.rl.group_size if r.grpo else 1


def length_grouped(r) -> bool:
    """Whether the Trainer batches by length: unpacked SFT rows are (less padding). Preference pairs are drawn at
    random: a length-grouped epoch's order depends on grad-accum (reshard.refuse_unresumable), so a resume at
    another world size could not keep it."""
    return not r.data.packing and not r.pairs and not r.grpo


def grad_accum(global_batch_tokens: int, seq_len: int, micro_batch_size: int, world_size: int, rows: int = 1) -> int:
    """Micro-batches per optimizer step: the one formula. Where the batch does not divide exactly (derive refuses
    it; the planner still sizes it), the next whole number."""
    return max(1, -(-global_batch_tokens // (seq_len * rows * micro_batch_size * world_size)))


def derive(global_batch_tokens: int, seq_len: int, micro_batch_size: int, world_size: int,
           rows: int = 1, sequence_parallel: int = 1, grpo: bool = False) -> BatchPlan:
    if world_size % sequence_parallel:
        raise BatchError(f"{world_size} ranks cannot be split into groups of train.sequence_parallel="
                         f"{sequence_parallel}: run on a multiple of {sequence_parallel} GPUs (or train.cpu_procs), "
                         f"or choose a divisor of {world_size}.")
    dp = world_size // sequence_parallel
    per = seq_len * rows * micro_batch_size * dp
    if global_batch_tokens % per:
        lo = max(1, global_batch_tokens // per)
        hi = lo + 1
        ranks = "world" if sequence_parallel == 1 else "data-parallel ranks (world / sequence_parallel)"
        what = (f"rl.group_size x seq_len x micro-batch (prompts) x {ranks}" if grpo else
                f"2 rows x seq_len x micro-batch (pairs) x {ranks}" if rows == 2 else
                f"seq_len x micro-batch x {ranks}")
        factors = " x ".join(str(x) for x in ((rows,) if rows > 1 else ()) + (seq_len, micro_batch_size, dp))
        raise BatchError(
            f"train.global_batch_tokens={global_batch_tokens:,} is not a multiple of {what} "
            f"= {factors} = {per:,}. Nearest valid: {lo * per:,} "
            f"(grad-accum {lo}) or {hi * per:,} (grad-accum {hi}).")
    return BatchPlan(global_batch_tokens, seq_len, micro_batch_size, world_size,
                     grad_accum(global_batch_tokens, seq_len, micro_batch_size, dp, rows), rows, sequence_parallel,
                     grpo)


def of_recipe(r, world_size: int) -> BatchPlan:
    """The recipe's own batch on `world_size` ranks: the one call every stage makes (worker, planner, resharding)."""
    return derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, world_size,
                  rows_per_sample(r), r.train.sequence_parallel, r.grpo)
