"""GRPO's prompts in the prepared rows, read without torch (the launcher checks them before any worker starts).

A row's prompt is its tokens before its last assistant turn's labels (the chat template's generation header included:
the tokens add_generation_prompt would give), its reference the text of that turn (`split_row`). So a user's SFT data
is GRPO data as it is, and the reward compares a completion with what the data says is right.
"""

from __future__ import annotations

from ..data.tokenize import IGNORE
from ..errors import UserError
from ..layout import layout


def split_row(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, reference ids) of a prepared row: the prompt ends where its last run of label tokens starts."""
    end = max((i for i, t in enumerate(labels) if t != IGNORE), default=None)
    if end is None:
        return list(input_ids), []
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return list(input_ids[:start]), list(input_ids[start:end + 1])


def refuse_long_prompts(r) -> None:
    """Before the launch: a training prompt longer than data.seq_len - rl.max_new_tokens would cut its micro-batch's
    completions short (objective.rollouts gives a micro-batch what its longest prompt leaves of the row), and the
    plan's rollout memory (Target.rollout_shape) assumes none is longer. One message naming the longest, and the fix."""
    import datasets

    limit = r.data.seq_len - r.rl.max_new_tokens
    rows = datasets.load_from_disk(str(layout(r).data_train)).select_columns(["input_ids", "labels"])
    long = [(n, i) for i, row in enumerate(rows) if (n := len(split_row(row["input_ids"], row["labels"])[0])) > limit]
    if long:
        n, i = max(long)
        raise UserError(f"{len(long)} of {len(rows)} GRPO prompts in {layout(r).data_train} are longer than "
                        f"data.seq_len - rl.max_new_tokens = {limit} tokens (the longest, prepared row {i}: {n:,}), "
                        "so their completions would be cut short: raise data.seq_len to "
                        f"{n + r.rl.max_new_tokens:,}, lower rl.max_new_tokens to {r.data.seq_len - n}, or drop those "
                        "prompts from the data, then run `make data` again")
