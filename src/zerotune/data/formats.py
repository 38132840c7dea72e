"""Turn a row of any supported format into chat messages (or raw text), validated.

Formats: `messages` (system/user/assistant, multi-turn), `instruction`
(instruction/input/output), `prompt_completion` (prompt/completion) and `text`
(continued pretraining). `columns` in the recipe maps the names a data set uses
onto these.
"""

from __future__ import annotations

from .sources import BadSample

ROLES = {"system", "user", "assistant"}
FIELDS = {
    "messages": ["messages"],
    "instruction": ["instruction", "input", "output"],
    "prompt_completion": ["prompt", "completion"],
    "text": ["text"],
}
OPTIONAL = {"input", "system"}


def _get(row: dict, name: str, columns: dict, where: str, fmt: str):
    col = columns.get(name, name)
    if col not in row or row[col] is None:
        if name in OPTIONAL:
            return None
        present = ", ".join(sorted(row)) or "none"
        raise BadSample(where, f"missing field '{col}' for format '{fmt}' (fields present: {present}).",
                        f"map it in the recipe, e.g. data.sources[i].columns: {{{name}: <your column>}}.")
    return row[col]


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise BadSample(where, f"{what} must be a string, got {type(value).__name__}.")
    if not value.strip():
        raise BadSample(where, f"{what} is empty.", "remove the row or fill in the content.")
    return value


def to_messages(row: dict, fmt: str, columns: dict, where: str) -> list[dict] | str:
    """Chat messages for chat formats, a string for `text`."""
    if fmt == "text":
        return _text(_get(row, "text", columns, where, fmt), where, "text")
    if fmt == "instruction":
        instr = _text(_get(row, "instruction", columns, where, fmt), where, "instruction")
        extra = _get(row, "input", columns, where, fmt)
        user = f"{instr}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instr
        msgs = [{"role": "user", "content": user},
                {"role": "assistant", "content": _get(row, "output", columns, where, fmt)}]
    elif fmt == "prompt_completion":
        msgs = [{"role": "user", "content": _get(row, "prompt", columns, where, fmt)},
                {"role": "assistant", "content": _get(row, "completion", columns, where, fmt)}]
    elif fmt == "messages":
        msgs = _get(row, "messages", columns, where, fmt)
        if not isinstance(msgs, list) or not msgs:
            raise BadSample(where, "'messages' must be a non-empty list of {role, content} objects.")
    else:  # the schema's Literal makes this unreachable from a recipe
        raise ValueError(f"unknown format {fmt}")
    return validate_messages(msgs, where)


def validate_messages(msgs: list, where: str) -> list[dict]:
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadSample(where, f"message {i} must be an object with 'role' and 'content'.")
        role = m["role"]
        if role not in ROLES:
            raise BadSample(where, f"message {i} has unknown role '{role}'.",
                            f"use one of {sorted(ROLES)} (map e.g. 'human'->'user', 'gpt'->'assistant' before preparing).")
        out.append({"role": role, "content": _text(m["content"], where, f"message {i} ({role}) content")})
    if not any(m["role"] == "assistant" for m in out):
        raise BadSample(where, "conversation has no assistant turn, so it has no label tokens (its loss would be 0/0 = NaN).",
                        "add an assistant reply or remove the row.")
    return out
