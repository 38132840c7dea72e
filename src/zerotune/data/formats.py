"""Turn a row of any supported format into chat messages (or raw text), validated.

Formats: `messages` (system/user/assistant, multi-turn), `instruction`
(instruction/input/output, optional system), `prompt_completion`
(prompt/completion, optional system) and `text` (continued pretraining).
`columns` in the recipe maps the names a data set uses onto these, e.g.
`columns: {messages: conversations, output: response}`.
"""

from __future__ import annotations

import difflib
import json

from .sources import BadSample

ROLES = {"system", "user", "assistant"}
FIELDS = {
    "messages": ["messages"],
    "instruction": ["instruction", "input", "output"],
    "prompt_completion": ["prompt", "completion"],
    "text": ["text"],
}
OPTIONAL = {"input", "system"}
SYNONYMS = {  # common names for a field in public data sets, tried when the field is missing
    "messages": ["conversations", "conversation", "messages", "dialog", "chat", "turns"],
    "instruction": ["instruction", "question", "prompt", "query", "task"],
    "output": ["output", "response", "answer", "completion", "target", "chosen"],
    "prompt": ["prompt", "question", "query", "instruction", "input"],
    "completion": ["completion", "response", "answer", "output", "target", "chosen"],
    "text": ["text", "content", "document", "body"],
}
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}


def _get(row: dict, name: str, columns: dict, where: str, fmt: str):
    col = columns.get(name, name)
    if col not in row or row[col] is None:
        if name in OPTIONAL:
            return None
        present = sorted(str(k) for k in row)
        used = {columns.get(f, f) for f in FIELDS.get(fmt, [])} - {col}
        free = [p for p in present if p not in used]
        close = [s for s in SYNONYMS.get(name, []) if s in free][:1] or difflib.get_close_matches(col, free, n=1, cutoff=0.6)
        guess = close[0] if close else "<your column>"
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise BadSample(where, f"missing field '{col}' for format '{fmt}' (fields present: {', '.join(present) or 'none'}).{hint}",
                        f"map it in the recipe: data.sources[i].columns: {{{name}: {guess}}}, "
                        f"or pick the right format (one of {sorted(FIELDS)}).")
    return row[col]


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise BadSample(where, f"{what} must be a string, got {type(value).__name__}.",
                        "store text content as a JSON string.")
    if not value.strip():
        raise BadSample(where, f"{what} is empty.", "remove the row or fill in the content.")
    return value


def _system(row: dict, columns: dict, where: str, fmt: str) -> list[dict]:
    s = _get(row, "system", columns, where, fmt)
    return [{"role": "system", "content": s}] if isinstance(s, str) and s.strip() else []


def to_messages(row: dict, fmt: str, columns: dict, where: str) -> list[dict] | str:
    """Chat messages for chat formats, a string for `text`."""
    if fmt == "text":
        return _text(_get(row, "text", columns, where, fmt), where, "text")
    if fmt == "instruction":
        instr = _text(_get(row, "instruction", columns, where, fmt), where, "instruction")
        extra = _get(row, "input", columns, where, fmt)
        if extra is not None and not isinstance(extra, str):
            raise BadSample(where, f"input must be a string, got {type(extra).__name__}.")
        user = f"{instr}\n\n{extra}" if extra and extra.strip() else instr
        msgs = _system(row, columns, where, fmt) + [
            {"role": "user", "content": user},
            {"role": "assistant", "content": _get(row, "output", columns, where, fmt)}]
    elif fmt == "prompt_completion":
        msgs = _system(row, columns, where, fmt) + [
            {"role": "user", "content": _get(row, "prompt", columns, where, fmt)},
            {"role": "assistant", "content": _get(row, "completion", columns, where, fmt)}]
    elif fmt == "messages":
        msgs = _get(row, "messages", columns, where, fmt)
        if isinstance(msgs, str) and msgs.lstrip().startswith("["):  # CSV cells hold JSON text
            try:
                msgs = json.loads(msgs)
            except json.JSONDecodeError as e:
                raise BadSample(where, f"'messages' holds malformed JSON ({e.msg}).") from None
        if not isinstance(msgs, list) or not msgs:
            raise BadSample(where, "'messages' must be a non-empty list of {role, content} objects.")
    else:  # the schema's Literal makes this unreachable from a recipe
        raise ValueError(f"unknown format {fmt}")
    return validate_messages(msgs, where)


def validate_messages(msgs: list, where: str) -> list[dict]:
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            fix = ("this looks like ShareGPT ({from, value}); convert to {role, content} first."
                   if isinstance(m, dict) and {"from", "value"} <= set(m) else "every message needs 'role' and 'content'.")
            raise BadSample(where, f"message {i} must be an object with 'role' and 'content' (got {keys}).", fix)
        role = m["role"]
        if role not in ROLES:
            alias = ROLE_ALIASES.get(str(role).lower())
            raise BadSample(where, f"message {i} has unknown role '{role}'.",
                            f"use one of {sorted(ROLES)}" + (f" ('{role}' is probably '{alias}')" if alias else "")
                            + "; rename roles before preparing.")
        if role == "system" and i != 0:
            raise BadSample(where, f"message {i} is a system message after the first turn.",
                            "put the system message first or merge it into a user turn.")
        out.append({"role": role, "content": _text(m["content"], where, f"message {i} ({role}) content")})
    if not any(m["role"] == "assistant" for m in out):
        raise BadSample(where, "conversation has no assistant turn, so it has no label tokens (its loss would be 0/0 = NaN).",
                        "add an assistant reply or remove the row.")
    return out
