"""What a tokenizer's chat template says, found once, for every stage that generates or checks generation.

- hf_end_tokens / stop_ids: where HF generation stops (generation_config's eos, the tokenizer's eos, the token
  that ends an assistant turn in the template). answering.py stops its greedy answers there (check, eval, data
  replay and the samples during training, evaluation.py); gguf_checks.py demands the GGUF stops there too;
  evaluate.py gives lm-eval the turn end as its stop string.
- tool_support: which tool features (tool definitions, assistant tool calls, tool replies) the template renders,
  by probe conversations; gguf_checks.py compares HF's and llama.cpp's prompts only as far as it does.
  data/tokenize.py (ChatRenderer) runs the same probes to refuse training data its template drops.
- CHAT_FORMAT: the llama-cpp-python chat format that makes a GGUF answer through its own embedded template
  (answering.py, gguf_checks.py, serve.py).

No zerotune imports: a leaf the data, answering, checking and serving modules can all read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

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
    weights.local_folder), where generation_config.json is read."""
    ends = hf_end_tokens(tok, model_dir)
    return sorted(set(ends["eos_ids"]) | ({ends["turn_end_id"]} if ends["turn_end_id"] is not None else set()))


# Probe conversations: a template renders a feature when the probe's marker comes out in its text. Each probe
# goes without the others' features, so each answer is about that feature alone.
_PROBE_USER = {"role": "user", "content": "Hi"}
_PROBE_CALL = {"role": "assistant", "tool_calls": [{"id": "call0", "type": "function", "function": {
    "name": "zerotune_probe_call", "arguments": {"q": "x"}}}]}
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


def tool_support(tok, render: Callable[[list[dict], bool, list | None], str] | None = None) -> dict:
    """{feature: None if the chat template renders it, else why not}, one probe per feature. render(messages,
    add_generation_prompt, tools) -> text: default the tokenizer's apply_chat_template; a faster renderer that
    equals it (data/tokenize.py ChatRenderer) may be given."""
    if render is None:
        def render(msgs, gen, tools):
            return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    support = {}
    for feature, (msgs, gen, tools, marker) in TOOL_PROBES.items():
        try:
            ok = marker in render(msgs, gen, tools)
            support[feature] = None if ok else "a probe's name does not come out in its text"
        except Exception as e:  # noqa: BLE001 - a template that raises on it does not render it either
            support[feature] = f"it raised {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return support
