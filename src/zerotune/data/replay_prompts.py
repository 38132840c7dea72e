"""The prompts of self-distilled replay (`data.replay.path`), read and checked: chat prompts that end with the user
turn the base model answers. A leaf: the data step (data/replay.py) answers them, the planner (planner/replay.py)
counts and bounds them before that, and neither needs the other.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import Recipe, resolve_path
from ..errors import MissingInputError, UserError


class ReplayError(UserError, ValueError):
    pass


def prompt_file(r: Recipe) -> Path:
    path = resolve_path(r.data.replay.path)
    if path is None or not path.is_file():
        raise MissingInputError(f"data.replay.path: {path} not found; it must be a JSONL of general prompts, one "
                                f"{{\"messages\": [{{\"role\": \"user\", \"content\": \"...\"}}]}} per line "
                                f"(data/general/prompts.jsonl ships with zerotune).")
    return path


def load_prompts(r: Recipe) -> list[dict]:
    """The replay prompts: chat prompts that end with a user turn, the first data.replay.limit of them."""
    path = prompt_file(r)
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{r.data.replay.path} line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReplayError(f"{where}: not valid JSON ({e.msg}); each line is one {{\"messages\": [...]}} "
                              f"object.") from None
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user",
                                                                                                 "assistant")
                for m in msgs):
            raise ReplayError(f"{where}: needs 'messages', a list of {{role, content}} turns (system, user, "
                              f"assistant) with string content.")
        if msgs[-1]["role"] != "user":
            raise ReplayError(f"{where}: the last turn is '{msgs[-1]['role']}'; a replay prompt ends with the user "
                              f"turn the base model answers.")
        extra = sorted(set(row) - {"messages"})
        if extra:
            raise ReplayError(f"{where}: unexpected key(s) {extra}: a replay prompt is only 'messages' (the base "
                              f"model writes the answer); remove them.")
        rows.append({"messages": msgs})
        if r.data.replay.limit is not None and len(rows) >= r.data.replay.limit:
            break
    if not rows:
        raise ReplayError(f"{r.data.replay.path}: no prompts; data.replay needs at least one.")
    return rows
