"""What a tokenizer's chat template says, found once, for every stage that generates or checks generation.

- hf_end_tokens / stop_ids: where HF generation stops (generation_config's eos, the tokenizer's eos, the token
  that ends an assistant turn in the template). answering.py stops its greedy answers there (check, eval, data
  replay and the samples during training, train/validation.py); gguf_checks.py demands the GGUF stops there too;
  evaluate.py gives lm-eval the turn end as its stop string.
- tool_support: which tool features (tool definitions, assistant tool calls, tool replies) the template renders,
  by probe conversations, and the form (CALL_FORMS) a tool-call turn must take for it; data/tokenize.py
  (ChatRenderer) trains in that form and refuses data its template drops, gguf_checks.py compares HF's and
  llama.cpp's prompts only as far as it renders.
- CHAT_FORMAT: the llama-cpp-python chat format that makes a GGUF answer through its own embedded template
  (answering.py, gguf_checks.py, serve.py).

No zerotune imports: a leaf the data, answering, checking and serving modules can all read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

# llama-cpp-python replaces an embedded template it recognises with a hand-written formatter ("llama-3" for
# the Llama-3 template), which does not `trim` message content as the template does: the served prompt then
# differs from HF's and from training. zerotune always asks for the embedded template by this name.
CHAT_FORMAT = "chat_template.default"

_ANSWER_MARK = "zerotune probe answer"


def hf_end_tokens(tok, model_dir: Path) -> dict:
    """Where HF generation stops: generation_config eos ids, the tokenizer's eos, and the chat template's
    end-of-turn token (the token right after an assistant message's content)."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    turn_end = None
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": _ANSWER_MARK}], tokenize=False)
        tail = text.split(_ANSWER_MARK, 1)[1] if _ANSWER_MARK in text else ""
        tail_ids = tok(tail, add_special_tokens=False)["input_ids"]
        if tail_ids:
            turn_end = tail_ids[0]
    return {"eos_ids": sorted(ids), "turn_end_id": turn_end}


def stop_ids(tok, model_dir: Path) -> list[int]:
    """The token ids greedy chat answers stop at: every HF end token and the template's end of turn
    (<|eot_id|> for Llama 3, <|im_end|> for ChatML), sorted. model_dir: a local folder (a hub id: its snapshot,
    hub.local_folder), where generation_config.json is read."""
    ends = hf_end_tokens(tok, model_dir)
    return sorted(set(ends["eos_ids"]) | ({ends["turn_end_id"]} if ends["turn_end_id"] is not None else set()))


class CallForm(NamedTuple):
    empty_content: bool   # content "" on a tool-call turn without text (OpenAI's data: null, left out)
    json_arguments: bool  # the call's arguments as JSON text (the data: an object, data/formats.py _arguments)


# How a tool-call turn may reach a template, tried in this order, the form the data has first (OpenAI's, which
# apply_chat_template passes on as it is). Templates differ: Qwen3's reads `.content` on every assistant turn and
# fails without one; one that prints the arguments as they come, without `tojson`, would print a Python dict.
CALL_FORMS = (CallForm(False, False), CallForm(True, False), CallForm(False, True), CallForm(True, True))


def in_form(msgs: list[dict], form: CallForm) -> list[dict]:
    """The conversation with its tool-call turns in `form` (the same list when there is nothing to change)."""
    if form == CALL_FORMS[0] or not any(m.get("tool_calls") for m in msgs):
        return msgs
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            m = dict(m)
            if form.empty_content and m.get("content") is None:
                m["content"] = ""
            if form.json_arguments:
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]
        out.append(m)
    return out


# Probe conversations: a template renders a feature when the probe's marker comes out in its text. Each probe
# goes without the others' features, so each answer is about that feature alone.
_PROBE_USER = {"role": "user", "content": "Hi"}
_PROBE_ARGUMENTS = {"q": "zerotune_probe_value"}  # printed as a Python dict: the template wants JSON text
_PROBE_CALL = {"role": "assistant", "tool_calls": [{"id": "call0", "type": "function", "function": {
    "name": "zerotune_probe_call", "arguments": _PROBE_ARGUMENTS}}]}
_PROBE_TOOLS = [{"type": "function", "function": {"name": "zerotune_probe_tool", "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "q": {"type": "string"}}, "required": ["q"]}}}]
TOOL_PROBES = {  # feature -> (messages, generation prompt, tools, marker)
    "tools": ([_PROBE_USER], True, _PROBE_TOOLS, "zerotune_probe_tool"),
    "tool calls": ([_PROBE_USER, _PROBE_CALL], False, None, "zerotune_probe_call"),
    "tool replies": ([_PROBE_USER, {"role": "assistant", "content": "Calling."},
                      {"role": "tool", "tool_call_id": "call0", "name": "zerotune_probe_call",
                       "content": "zerotune_probe_result"}], True, None, "zerotune_probe_result"),
}


def tool_support(tok, render: Callable[[list[dict], bool, list | None], str] | None = None
                 ) -> tuple[dict, CallForm]:
    """({feature: None if the chat template renders it, else why not}, the CallForm its tool calls render in), one
    probe per feature, a tool call in each of CALL_FORMS until one renders. render(messages, add_generation_prompt,
    tools) -> text: default the tokenizer's apply_chat_template; a faster renderer that equals it
    (data/tokenize.py ChatRenderer) may be given."""
    if render is None:
        def render(msgs, gen, tools):
            return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    support, call_form = {}, CALL_FORMS[0]
    for feature, (msgs, gen, tools, marker) in TOOL_PROBES.items():
        said, raised = [], []
        for form in CALL_FORMS if feature == "tool calls" else CALL_FORMS[:1]:
            try:
                text = render(in_form(msgs, form), gen, tools)
            except Exception as e:  # noqa: BLE001 - a template that raises on it does not render it either
                raised.append(f"it raised {type(e).__name__}: {' '.join(str(e).split())[:160]}")
                continue
            if marker not in text:
                said.append("its text leaves them out")
            elif repr(_PROBE_ARGUMENTS) in text:
                said.append("it prints a call's arguments as a Python dict")
            else:
                support[feature] = None
                if feature == "tool calls":
                    call_form = form
                break
        else:  # what it does in a form it accepts is the truth about it; else its first error
            support[feature] = (said or raised)[0]
    return support, call_form
