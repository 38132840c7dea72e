"""The table of data formats (`FORMATS`), stated once, and the form of tool definitions: a leaf that imports nothing
of zerotune, so the recipe's schema (config.py) and the row readers (data/formats.py) both stand on it.

`FORMATS` holds one `Format` per name: what it is, the row fields it reads (required and optional), the names
public data sets use for them, whether it is rendered by the chat template, the message keys and role names of
the formats whose rows hold a message list, and which of data/formats.py's readers reads a row. Every reader of
formats derives from it:
- config.py: the recipe's `data.sources[i].format` names (the schema's Literal, did-you-mean), the names its
  `columns` may map, which formats take `roles` and `tools`, the help `zerotune explain` prints;
- data/prepare.py and data/tokenize.py: which sources need a chat template, and the error that says so;
- data/formats.py's `read_row`: which fields a row must have, what to suggest when one is missing;
- tests/test_docs.py: docs/data.md shows one row of every format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = {"system", "user", "assistant", "tool"}
OUR_ROLES = {r: r for r in ROLES}  # the role names of our own message-list formats: each is itself
# What `roles` may map a data set's role names onto; tool_call = an assistant turn whose text is a tool call
ROLE_TARGETS = ("system", "user", "assistant", "tool", "tool_call")
# ShareGPT's role names as the public sets spell them (and LLaMA-Factory's function_call/observation turns)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "system": "system", "function_call": "tool_call",
                  "tool_call": "tool_call", "observation": "tool", "tool": "tool", "function": "tool"}


@dataclass(frozen=True)
class Format:
    name: str
    what: str                         # one line: the recipe's help text (`zerotune explain`)
    fields: tuple[str, ...]           # the row fields it reads, in the order docs/data.md shows them
    optional: tuple[str, ...]         # those of them a row may leave out (or null)
    aliases: dict                     # field -> names public data sets give it, suggested when it is missing
    chat: bool                        # rendered by the chat template; False: the text alone, between BOS and EOS
    reader: str                       # which reader of data/formats.py (its READERS) turns a row into a conversation
    message_keys: dict | None = None  # a row holding a message list: its field and message keys, as the data names them
    roles: dict | None = None         # and its role names -> ours
    pair: bool = False                # a preference pair (read into a Pair): trained by preference.method, not SFT

    @property
    def columns(self) -> tuple[str, ...]:
        """The names `data.sources[i].columns` may map: the row fields, then the message keys."""
        return self.fields + (("role", "content") if self.message_keys else ())


_MESSAGES_ALIASES = {"messages": ("conversations", "conversation", "messages", "dialog", "chat", "turns")}
# name -> Format; the recipe's schema, the readers, prepare and the docs test read it (see the module docstring)
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("messages", "OpenAI chat fine-tuning rows {messages: [{role, content}]} with per-turn weight, tools and "
           "tool calls", fields=("messages", "system", "tools"), optional=("system", "tools"),
           aliases=_MESSAGES_ALIASES, chat=True, reader="chat",
           message_keys={"messages": "messages", "role": "role", "content": "content"}, roles=OUR_ROLES),
    Format("sharegpt", "ShareGPT rows {conversations: [{from, value}]} with ShareGPT's role names",
           fields=("messages", "system", "tools"), optional=("system", "tools"), aliases=_MESSAGES_ALIASES,
           chat=True, reader="chat",
           message_keys={"messages": "conversations", "role": "from", "content": "value"}, roles=SHAREGPT_ROLES),
    Format("instruction", "Alpaca rows {instruction, input (optional), output}",
           fields=("instruction", "input", "output", "system", "tools"), optional=("input", "system", "tools"),
           aliases={"instruction": ("instruction", "question", "prompt", "query", "task"),
                    "output": ("output", "response", "answer", "completion", "target", "chosen")},
           chat=True, reader="instruction"),
    Format("prompt_completion", "{prompt, completion} rows, one user turn and one reply",
           fields=("prompt", "completion", "system", "tools"), optional=("system", "tools"),
           aliases={"prompt": ("prompt", "question", "query", "instruction", "input"),
                    "completion": ("completion", "response", "answer", "output", "target", "chosen")},
           chat=True, reader="prompt_completion"),
    Format("text", "{text} rows, every token trained, no chat template (continued pretraining)",
           fields=("text",), optional=(), aliases={"text": ("text", "content", "document", "body")},
           chat=False, reader="text"),
    Format("preference", "TRL preference pairs {prompt, chosen, rejected} (strings or message lists); without prompt, or "
           "repeating it: full conversations sharing a prompt prefix (UltraFeedback, HH-RLHF)",
           fields=("prompt", "chosen", "rejected", "system"), optional=("prompt", "system"),
           aliases={"prompt": ("prompt", "question", "instruction", "input", "query"),
                    "chosen": ("chosen", "preferred", "chosen_response", "response_chosen", "accepted"),
                    "rejected": ("rejected", "non_preferred", "rejected_response", "response_rejected")},
           chat=True, reader="preference", message_keys={"role": "role", "content": "content"}, roles=OUR_ROLES,
           pair=True),
    Format("openai_preference", "OpenAI preference fine-tuning rows {input: {messages, tools}, preferred_output, "
           "non_preferred_output}", fields=("input", "preferred_output", "non_preferred_output"), optional=(),
           aliases={"preferred_output": ("preferred_output", "chosen"),
                    "non_preferred_output": ("non_preferred_output", "rejected")},
           chat=True, reader="openai_preference", message_keys={"role": "role", "content": "content"},
           roles=OUR_ROLES, pair=True),
)}


def tool_definitions(value, what: str = "tools") -> list | None:
    """Tool definitions as chat templates take them: OpenAI's [{type: function, function: {name, ...}}], for a
    source (data.sources[i].tools, checked by config.py at load) and for a row's own (data/formats.py). Bare {name,
    description, parameters} items (LLaMA-Factory, glaive) are wrapped into that form; JSON text is parsed; an empty
    list, "" or null is no tools. Raises ValueError(reason, fix)."""
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"'{what}' holds malformed JSON ({e.msg} at column {e.colno}).",
                             "repair the JSON in that field.") from None
    if value is None or value == "" or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"'{what}' must be a list of tool definitions, got {type(value).__name__}.",
                         "use OpenAI's form: [{\"type\": \"function\", \"function\": {\"name\": ..., "
                         "\"parameters\": {...}}}].")
    out = []
    for k, t in enumerate(value):
        t = t if "function" in t else {"type": "function", "function": t}
        if not isinstance(t["function"], dict) or not isinstance(t["function"].get("name"), str):
            raise ValueError(f"'{what}' item {k} has no function name.",
                             "each tool needs {\"type\": \"function\", \"function\": {\"name\": ...}}.")
        out.append(t)
    return out
