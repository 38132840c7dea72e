"""How a row of each data format becomes a conversation (or raw text), validated, with every key accounted for.

The formats themselves are one table, `FORMATS` in format_table.py (a leaf, which the recipe's schema reads too):
each names its reader here (`READERS`), the row fields it reads and the names public data sets give them.

What the readers honour (the same for every chat format): OpenAI's chat fine-tuning format, all of it:
system/user/assistant/tool turns, assistant `tool_calls` (content null), tool replies (`tool_call_id`), and
`"weight": 0|1` on assistant turns (0 = no loss). Rows of format `messages` whose messages are ShareGPT-shaped
({from, value}) are read as `sharegpt` and counted, so prepare can say what it detected. ShareGPT's
function_call/observation turns (LLaMA-Factory's layout: a call's value is the call as JSON) are tool calls and
tool replies. `columns` maps a data set's names onto ours (row fields and, for message-list formats, the
message keys `role` and `content`); `roles` maps its role names onto ours (format_table.ROLE_TARGETS).

Nothing is dropped silently. Every key of a row or message is honoured, refused (BadSample: file, line, fix),
or reported back as ignored in `Doc.notes`, which prepare counts per source in the manifest and the log. A null
value counts as absent (exports carry `"name": null` and friends). Keys that change what is trained (`weight`,
`tool_calls`, `truncated`, `loss`, `train`) are never ignored: honoured where zerotune can do what they ask,
refused where it cannot.

Preference pairs (formats with `pair=True`, read into a `Pair`: one prompt, a chosen and a rejected completion, labels
on the completions only): TRL's prompt/chosen/rejected, standard (strings) and conversational (message lists);
the same rows without a prompt or repeating it in chosen and rejected (UltraFeedback, HH-RLHF: full conversations
sharing a prompt prefix, found and counted so prepare says so; HH-RLHF's "\n\nHuman: ... \n\nAssistant: ..." text is
split into turns); OpenAI's preference fine-tuning rows (input.messages, preferred_output, non_preferred_output).
A pair whose completions are identical, empty, or share no prompt is refused like any bad row.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass

from ..errors import BadSample
from ..format_table import FORMATS, OUR_ROLES, ROLES, Format, tool_definitions

# What an unknown role is probably called in ours, for the error that names it
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
# Keys that change what is trained. Never ignored: read where they are honoured, refused anywhere else.
NOT_READ = {
    "loss": "zerotune reads OpenAI's per-turn \"weight\": 0|1 instead",
    "train": "zerotune reads OpenAI's per-turn \"weight\": 0|1 instead",
    "function_call": "use \"tool_calls\" (OpenAI's current format) instead of the legacy function_call",
    "functions": "use \"tools\" (OpenAI's current format) instead of the legacy functions",
}


@dataclass
class Pair:
    """A preference pair: the prompt both completions follow (its assistant turns carry weight 0: no labels) and the
    chosen and rejected completions, each starting with an assistant turn; tools: the row's own, if any."""
    prompt: list
    chosen: list
    rejected: list
    tools: list | None = None


@dataclass
class Doc:
    """One row, read: chat messages (a Pair for pair formats; the text for format text), the tools its template renders, and what
    prepare counts for its source (ignored keys, a detected format, tool rows, weight-0 turns); None if nothing."""
    conv: list | str | Pair
    tools: list | None = None
    notes: dict | None = None


def _get(row: dict, name: str, columns: dict, where: str, fmt: Format):
    col = columns.get(name, name)
    if col not in row or row[col] is None:
        if name in fmt.optional:
            return None
        present = sorted(str(k) for k in row)
        used = {columns.get(f, f) for f in fmt.fields} - {col}
        free = [p for p in present if p not in used]
        close = [s for s in fmt.aliases.get(name, ()) if s in free][:1] or difflib.get_close_matches(col, free, n=1, cutoff=0.6)
        guess = close[0] if close else "<your column>"
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise BadSample(where, f"missing field '{col}' for format '{fmt.name}' (fields present: {', '.join(present) or 'none'}).{hint}",
                        f"map it in the recipe: data.sources[i].columns: {{{name}: {guess}}}, "
                        f"or pick the right format (one of {sorted(FORMATS)}).")
    return row[col]


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise BadSample(where, f"{what} must be a string, got {type(value).__name__}.",
                        "store text content as a JSON string.")
    if not value.strip():
        raise BadSample(where, f"{what} is empty.", "remove the row or fill in the content.")
    return value


def _json_cell(value, where: str, what: str):
    """A list or object stored as JSON text (CSV and parquet cells, ShareGPT call values) -> the value."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise BadSample(where, f"'{what}' holds malformed JSON ({e.msg} at column {e.colno}).",
                            "repair the JSON in that field.") from None
    return value


def _system(row: dict, columns: dict, where: str, fmt: Format) -> list[dict]:
    s = _get(row, "system", columns, where, fmt)
    if s is not None and not isinstance(s, str):
        raise BadSample(where, f"'system' must be a string, got {type(s).__name__}.")
    return [{"role": "system", "content": s}] if isinstance(s, str) and s.strip() else []


def normalize_tools(value, where: str, what: str = "tools") -> list | None:
    """A row's tools, as tool_definitions reads a source's: in OpenAI's form, or None."""
    try:
        return tool_definitions(value, what)
    except ValueError as e:
        raise BadSample(where, *e.args) from None


def _arguments(value, where: str, what: str) -> dict:
    """A call's arguments as a JSON object. OpenAI stores them as JSON text; chat templates (Llama-3.1's, Qwen's)
    expect the object and print it with `tojson`, so text would be trained double-encoded."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise BadSample(where, f"{what} arguments are not valid JSON ({e.msg}).",
                            "arguments must be a JSON object (or its JSON text).") from None
    if not isinstance(value, dict):
        raise BadSample(where, f"{what} arguments must be a JSON object, got {type(value).__name__}.",
                        "arguments must be a JSON object such as {\"city\": \"Paris\"} (or its JSON text).")
    return value


def _tool_calls(calls, where: str, i: int) -> list[dict]:
    """OpenAI's tool_calls, each passed on whole, its function's arguments parsed into an object."""
    if not isinstance(calls, list) or not calls:
        raise BadSample(where, f"message {i}: 'tool_calls' must be a non-empty list.",
                        "use [{\"id\": ..., \"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}].")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadSample(where, f"message {i}: tool call {k} has no function name.",
                            "each call is {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}.")
        out.append({**c, "function": {**fn, "arguments": _arguments(fn.get("arguments"), where,
                                                                    f"message {i}: tool call {k}")}})
    return out


def _sharegpt_call(value, where: str, i: int) -> list[dict]:
    """A ShareGPT function_call turn's value, {"name", "arguments"} or a list of them as JSON text, as tool_calls."""
    value = _json_cell(value, where, f"message {i} value")
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise BadSample(where, f"message {i} is a tool call, but its value is not {{\"name\": ..., \"arguments\": "
                               f"{{...}}}} (or a list of them).", "store the call as that JSON.")
    return [{"type": "function", "function": {"name": c["name"], "arguments": _arguments(
        c.get("arguments"), where, f"message {i}: tool call {k}")}} for k, c in enumerate(calls)]


def _count(notes: dict, key: str, n: int = 1) -> None:
    notes[key] = notes.get(key, 0) + n


def _message(m, i: int, role_key: str, content_key: str, role_map: dict, where: str, notes: dict) -> dict:
    if not isinstance(m, dict) or m.get(role_key) is None or (content_key not in m and "tool_calls" not in m):
        keys = sorted(m) if isinstance(m, dict) else type(m).__name__
        raise BadSample(where, f"message {i} must be an object with '{role_key}' and '{content_key}' (got {keys}).",
                        "every message needs both; map other key names with data.sources[i].columns: "
                        "{role: <your key>, content: <your key>}.")
    raw = m[role_key]
    role = role_map.get(raw) if isinstance(raw, str) else None
    if role is None:
        alias = ROLE_ALIASES.get(str(raw).lower())
        raise BadSample(where, f"message {i} has unknown role '{raw}'.",
                        f"use one of {sorted(ROLES)}" + (f" ('{raw}' is probably '{alias}')" if alias else "")
                        + f", or map it in the recipe: data.sources[i].roles: {{{raw}: {alias or 'user'}}}.")
    content = m.get(content_key)
    msg: dict = {"role": "assistant" if role == "tool_call" else role}
    # A tool-call turn's null content is left out, as apply_chat_template does (templates test for the key)
    if role == "tool_call":  # ShareGPT's function_call turn: the value is the call
        msg["tool_calls"] = _sharegpt_call(content, where, i)
    elif m.get("tool_calls") is not None:
        if role != "assistant":
            raise BadSample(where, f"message {i}: 'tool_calls' on a {role} turn.",
                            "tool calls belong to assistant turns.")
        if content is not None and not isinstance(content, str):
            raise BadSample(where, f"message {i} (assistant) content must be a string or null, got "
                                   f"{type(content).__name__}.", "store text content as a JSON string.")
        if content is not None:
            msg["content"] = content
        msg["tool_calls"] = _tool_calls(m["tool_calls"], where, i)
    elif role == "tool":
        if not isinstance(content, str):  # a tool may return nothing (""), but what it returns is text
            raise BadSample(where, f"message {i} (tool) content must be a string, got {type(content).__name__}.",
                            "store the tool's result as a JSON string.")
        msg["content"] = content
    else:
        msg["content"] = _text(content, where, f"message {i} ({role}) content")
    if msg.get("tool_calls"):
        _count(notes, "tool_call_turns")
    if role == "system" and i != 0:
        raise BadSample(where, f"message {i} is a system message after the first turn.",
                        "put the system message first or merge it into a user turn.")
    used = {role_key, content_key, "tool_calls"}
    if msg["role"] == "tool":
        for key in ("tool_call_id", "name"):  # which call this answers: the template's to render
            if m.get(key) is not None:
                msg[key] = m[key]
                used.add(key)
    if m.get("weight") is not None:  # OpenAI's per-turn loss switch
        w = m["weight"]
        ok = not isinstance(w, bool) and isinstance(w, (int, float)) and w in (0, 1)
        if not ok or (w == 1 and msg["role"] != "assistant"):
            raise BadSample(where, f"message {i} ({msg['role']}): weight {w!r}: only 0 or 1, and 1 only on assistant "
                                   f"turns (zerotune trains on assistant turns alone).",
                            "set \"weight\": 0 (no loss) or 1 on assistant turns, or remove it.")
        if w == 0 and msg["role"] == "assistant":
            msg["weight"] = 0
            _count(notes, "assistant_turns_weight_0")
        used.add("weight")
    if m.get("truncated") is not None:  # changes what is trained: honoured or refused, never ignored
        if msg["role"] != "assistant" or not isinstance(m["truncated"], bool) or (m["truncated"]
                                                                                 and msg.get("tool_calls")):
            raise BadSample(where, f"message {i}: 'truncated' must be true or false, on an assistant turn.",
                            "set \"truncated\": true on an assistant reply that was cut off, or remove it.")
        if m["truncated"]:
            msg["truncated"] = True
        used.add("truncated")
    for key, v in m.items():
        if key in used or v is None:
            continue
        if key in NOT_READ:
            raise BadSample(where, f"message {i}: key '{key}' would change what is trained, and zerotune does not "
                                   f"read it.", f"{NOT_READ[key]}; or remove it.")
        _count(notes, f"message:{key}")
    return msg


def validate_messages(msgs: list, where: str, role_key: str = "role", content_key: str = "content",
                      role_map: dict | None = None, notes: dict | None = None) -> list[dict]:
    """Chat messages in our form: role, content, and what the template or the labels read (tool_calls,
    tool_call_id/name on tool turns, weight 0, truncated). Ignored message keys are counted into `notes`."""
    notes = {} if notes is None else notes
    role_map = OUR_ROLES if role_map is None else role_map
    out = [_message(m, i, role_key, content_key, role_map, where, notes) for i, m in enumerate(msgs)]
    assistant = [m for m in out if m["role"] == "assistant"]
    if not assistant:
        raise BadSample(where, "conversation has no assistant turn, so it has no label tokens (its loss would be 0/0 = NaN).",
                        "add an assistant reply or remove the row.")
    if all(m.get("weight") == 0 for m in assistant):
        raise BadSample(where, "every assistant turn has weight 0, so the conversation has no label tokens (its loss "
                               "would be 0/0 = NaN).", "give one assistant turn weight 1 or remove the row.")
    return out


def _sharegpt_shaped(msgs, role_key: str) -> bool:
    return (isinstance(msgs, list) and bool(msgs) and isinstance(msgs[0], dict) and role_key not in msgs[0]
            and "from" in msgs[0] and "value" in msgs[0])


def _read_chat(row: dict, fmt: Format, columns: dict, where: str, roles: dict, notes: dict) -> tuple[list[dict], set]:
    cols = {**fmt.message_keys, **columns}
    if fmt.name == "messages" and cols["messages"] not in row and "messages" not in columns \
            and _sharegpt_shaped(row.get("conversations"), cols["role"]):
        cols["messages"] = "conversations"  # the usual ShareGPT row under the default format: detected below
    msgs = _json_cell(_get(row, "messages", cols, where, fmt), where, cols["messages"])
    if not isinstance(msgs, list) or not msgs:
        raise BadSample(where, f"'{cols['messages']}' must be a non-empty list of messages.")
    if fmt.name == "messages" and _sharegpt_shaped(msgs, cols["role"]):
        # {from, value} messages: ShareGPT under format messages. Read as such and counted; prepare says so.
        fmt = FORMATS["sharegpt"]
        cols = {**fmt.message_keys, **{k: v for k, v in columns.items() if k != "messages"},
                "messages": cols["messages"]}
        _count(notes, "detected_sharegpt")
    out = validate_messages(msgs, where, cols["role"], cols["content"], {**fmt.roles, **roles}, notes)
    system = _system(row, cols, where, fmt)
    if system and out[0]["role"] == "system":
        raise BadSample(where, f"the row has both a '{cols.get('system', 'system')}' field and a system message.",
                        "keep one of them.")
    return system + out, {cols["messages"], cols.get("system", "system"), cols.get("tools", "tools")}


def _named(fmt: Format, columns: dict) -> set:
    """The row keys a format's fields are read from."""
    return {columns.get(k, k) for k in fmt.fields}


def _read_instruction(row: dict, fmt: Format, columns: dict, where: str, roles: dict, notes: dict):
    instr = _text(_get(row, "instruction", columns, where, fmt), where, "instruction")
    extra = _get(row, "input", columns, where, fmt)
    if extra is not None and not isinstance(extra, str):
        raise BadSample(where, f"input must be a string, got {type(extra).__name__}.")
    user = f"{instr}\n\n{extra}" if extra and extra.strip() else instr
    conv = validate_messages(_system(row, columns, where, fmt) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": _get(row, "output", columns, where, fmt)}], where)
    return conv, _named(fmt, columns)


def _read_prompt_completion(row: dict, fmt: Format, columns: dict, where: str, roles: dict, notes: dict):
    conv = validate_messages(_system(row, columns, where, fmt) + [
        {"role": "user", "content": _get(row, "prompt", columns, where, fmt)},
        {"role": "assistant", "content": _get(row, "completion", columns, where, fmt)}], where)
    return conv, _named(fmt, columns)


def _read_text(row: dict, fmt: Format, columns: dict, where: str, roles: dict, notes: dict):
    return _text(_get(row, "text", columns, where, fmt), where, "text"), _named(fmt, columns)


# ---- preference pairs ---------------------------------------------------------------------------------

_HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):[ ]?")


def _hh_text(text: str, where: str, what: str) -> list[dict]:
    """HH-RLHF's conversation text ("\n\nHuman: ...\n\nAssistant: ...") as user/assistant turns."""
    parts = _HH_TURN.split(text)
    if parts[0].strip():
        raise BadSample(where, f"'{what}' has text before its first 'Human:' or 'Assistant:' turn.",
                        "HH-RLHF text starts with \"\\n\\nHuman: \"; or give the pair a 'prompt' field.")
    return [{"role": "user" if who == "Human" else "assistant", "content": body.strip()}
            for who, body in zip(parts[1::2], parts[2::2])]


def _turns(value, where: str, what: str, cols: dict, role_map: dict, notes: dict, reply: bool) -> list[dict]:
    """A pair field as messages: a string is one user turn (the prompt) or one assistant turn (a completion)."""
    if isinstance(value, str) and value.lstrip().startswith("["):  # a message list stored as JSON text (CSV,
        try:                                                         # parquet); a reply that is JSON stays text
            parsed = json.loads(value)
            value = parsed if isinstance(parsed, list) and all(isinstance(m, dict) and cols["role"] in m
                                                               for m in parsed) else value
        except json.JSONDecodeError:
            pass
    if isinstance(value, str):
        return [{"role": "assistant" if reply else "user", "content": _text(value, where, what)}]
    if not isinstance(value, list) or not value:
        raise BadSample(where, f"'{what}' must be a string or a non-empty list of messages.",
                        "use TRL's shapes: strings, or lists of {role, content} messages.")
    return [_message(m, i, cols["role"], cols["content"], role_map, f"{where} ({what})", notes)
            for i, m in enumerate(value)]


def _split_pair(prompt: list | None, chosen: list, rejected: list, where: str, notes: dict) -> Pair:
    """prompt (None: implicit) + completions -> a checked Pair. Completions that repeat the prompt, or rows without
    one, are full conversations: the prompt is their longest shared prefix of whole messages (counted in notes)."""
    if prompt is not None and chosen[:len(prompt)] == prompt and rejected[:len(prompt)] == prompt:
        _count(notes, "prompt_repeated")  # UltraFeedback: the prompt field and the conversations' first turn
        prompt = None
    if prompt is None:
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        _count(notes, "implicit_prompt")
    if not prompt:
        raise BadSample(where, "chosen and rejected share no prompt (they differ from their first message).",
                        "give the pair a prompt (a 'prompt' field, or the same first turns in both conversations).")
    if chosen == rejected:
        raise BadSample(where, "chosen and rejected are identical, so the pair prefers nothing.",
                        "remove the row, or fix the rejected completion.")
    for name, comp in (("chosen", chosen), ("rejected", rejected)):
        if not comp:
            raise BadSample(where, f"the {name} completion is empty (the conversation ends with the prompt).",
                            f"add the {name} reply, or remove the row.")
        if comp[0]["role"] != "assistant":
            raise BadSample(where, f"the {name} completion starts with a {comp[0]['role']} turn: chosen and "
                                   "rejected must differ from an assistant reply on, after one shared prompt.",
                            "put the shared turns in the prompt and each reply in its completion.")
        if all(m.get("weight") == 0 for m in comp if m["role"] == "assistant"):
            raise BadSample(where, f"the {name} completion has no assistant turn with labels (weight 0), so "
                                   "its log-probability is empty.", "remove the weight 0, or the row.")
    if prompt[-1]["role"] == "assistant":
        raise BadSample(where, "the prompt ends with an assistant turn, so both completions would continue it.",
                        "end the prompt with a user (or tool) turn.")
    return Pair([{**m, "weight": 0} if m["role"] == "assistant" else m for m in prompt], chosen, rejected)


def _read_preference(row: dict, fmt: Format, columns: dict, where: str, roles: dict, notes: dict):
    cols = {**fmt.message_keys, **columns}
    role_map = {**fmt.roles, **roles}
    raw = {k: _get(row, k, columns, where, fmt) for k in ("prompt", "chosen", "rejected")}
    if raw["prompt"] is None and all(isinstance(raw[k], str) for k in ("chosen", "rejected")):
        if not all(_HH_TURN.match(raw[k] or "") for k in ("chosen", "rejected")):
            raise BadSample(where, "chosen and rejected are strings but the row has no prompt field.",
                            "add the prompt (data.sources[i].columns: {prompt: <your column>}), or give full "
                            "conversations (lists of messages, or HH-RLHF's '\\n\\nHuman: ...' text).")
        _count(notes, "hh_text")
        comp = {k: _hh_text(raw[k], where, columns.get(k, k)) for k in ("chosen", "rejected")}
        for k in comp:
            comp[k] = [_message(m, i, "role", "content", OUR_ROLES, f"{where} ({k})", notes)
                       for i, m in enumerate(comp[k])]
    else:
        comp = {k: _turns(raw[k], where, columns.get(k, k), cols, role_map, notes, reply=True)
                for k in ("chosen", "rejected")}
    prompt = None if raw["prompt"] is None else _turns(raw["prompt"], where, columns.get("prompt", "prompt"), cols,
                                                       role_map, notes, reply=False)
    system = _system(row, columns, where, fmt)
    pair = _split_pair(prompt, comp["chosen"], comp["rejected"], where, notes)
    if system:
        if pair.prompt[0]["role"] == "system":
            raise BadSample(where, "the row has both a 'system' field and a system message.", "keep one of them.")
        pair.prompt = system + pair.prompt
    return pair, _named(fmt, columns)


def _read_openai_preference(row: dict, fmt: Format, columns: dict, where: str, roles: dict, notes: dict):
    cols = {**fmt.message_keys, **columns}
    role_map = {**fmt.roles, **roles}
    inp = _json_cell(_get(row, "input", columns, where, fmt), where, "input")
    if not isinstance(inp, dict) or not isinstance(inp.get("messages"), list) or not inp["messages"]:
        raise BadSample(where, "'input' must be an object with a non-empty 'messages' list.",
                        "use OpenAI's preference format: {\"input\": {\"messages\": [...]}, \"preferred_output\": "
                        "[...], \"non_preferred_output\": [...]}.")
    prompt = _turns(inp["messages"], where, "input.messages", cols, role_map, notes, reply=False)
    comp = {k: _turns(_get(row, k, columns, where, fmt), where, columns.get(k, k), cols, role_map, notes, reply=True)
            for k in ("preferred_output", "non_preferred_output")}
    pair = _split_pair(prompt, comp["preferred_output"], comp["non_preferred_output"], where, notes)
    pair.tools = normalize_tools(inp.get("tools"), where, "input.tools")
    for key, v in inp.items():
        if key not in ("messages", "tools") and v is not None:
            _count(notes, f"row:input.{key}")
    return pair, _named(fmt, columns)


# Format.reader -> the function that reads a row: (row, format, columns, where, roles, notes) -> (conversation | text,
# the row keys read)
READERS = {"chat": _read_chat, "instruction": _read_instruction, "prompt_completion": _read_prompt_completion,
           "text": _read_text, "preference": _read_preference, "openai_preference": _read_openai_preference}


def read_row(row: dict, fmt: str, columns: dict, where: str, roles: dict | None = None,
             tools: list | None = None) -> Doc:
    """A row of format `fmt` (a FORMATS name) -> Doc (its conv a Pair for pair formats). `tools`: the source's tool
    definitions, for rows without their own."""
    form = FORMATS[fmt]
    notes: dict = {}
    conv, used = READERS[form.reader](row, form, columns, where, roles or {}, notes)
    if form.chat:  # a pair's own tools were read by its format (OpenAI's input.tools)
        own = conv.tools if form.pair else normalize_tools(_get(row, "tools", columns, where, form), where,
                                                           columns.get("tools", "tools"))
        tools = own if own is not None else tools  # a row's own tools replace the source's
        if tools:
            _count(notes, "rows_with_tools")
    for key, v in row.items():
        if key in used or v is None:
            continue
        if key in NOT_READ or key == "weight":
            why = NOT_READ.get(key, "zerotune weighs sources (data.sources[i].weight) and assistant turns "
                                    "(\"weight\" on a message), not rows")
            raise BadSample(where, f"row key '{key}' would change what is trained, and zerotune does not read it.",
                            f"{why}; or remove it.")
        _count(notes, f"row:{key}")
    return Doc(conv, tools if form.chat else None, notes or None)


def to_messages(row: dict, fmt: str, columns: dict, where: str, roles: dict | None = None) -> list[dict] | str:
    """Chat messages for chat formats, a string for `text` (read_row without the tools and notes)."""
    return read_row(row, fmt, columns, where, roles).conv
