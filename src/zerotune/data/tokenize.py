"""Chat template rendering with assistant-only labels.

The tokenizer's own chat template renders the conversation. Labels are found
from character spans: the text rendered for messages[:i] plus the generation
prompt is where assistant turn i starts, the text for messages[:i+1] is where it
ends (its end-of-turn token included; a turn marked `"truncated": true` ends with its
own text, so a cut-off reply does not teach stopping there). One tokenization with offsets then maps
spans to tokens: a token is a label when it ends inside a span (so a token that
merges the prompt's trailing space with the reply's first word is a label). This
works for any template with the prefix property, which is checked per sample
rather than assumed; a template that renders the last assistant turn differently
from history (Qwen3's thinking block) has its earlier turns located in their
history form (_history_end). The ids are exactly those of
`tok.apply_chat_template(messages, tokenize=True)` (tests check it).

Which assistant turns carry labels: all of them (`loss_on: all_assistant`) or the last, less those marked
`"weight": 0` (OpenAI's per-turn switch), tool-call turns included. Tools (`tools=`) are rendered by the
template itself, as `apply_chat_template(..., tools=...)` does. A tool-call turn reaches each template in the
form it accepts (CALL_FORMS: Qwen3's template needs a content string where OpenAI's data has null); a
conversation that uses tools, tool calls or tool replies is refused, naming the tokenizer and what the template
does instead, when probes show the template drops them or fails on them in every form (ChatRenderer.require).

Speed: the compiled Jinja template is called directly (about 3x cheaper than
`apply_chat_template`, verified equal on the first conversation of every
process, and on the first with tools, else we fall back), and a chunk of samples is tokenized with one
`encode_batch` call.
"""

from __future__ import annotations

import numpy as np

from ..chat_template import CALL_FORMS, in_form, tool_support
from ..errors import BadSample, UserError
from ..format_table import FORMATS
from .formats import Pair

IGNORE = -100


class TemplateError(UserError, ValueError):
    pass


def require_chat_template(tok, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        chat = ", ".join(f.name for f in FORMATS.values() if f.chat)
        plain = " or ".join(f.name for f in FORMATS.values() if not f.chat)
        raise TemplateError(f"tokenizer {where} has no chat template, so chat data (formats {chat}) cannot be "
                            f"rendered. Fix: use a tokenizer that has one (e.g. the Instruct model's), add "
                            f"`chat_template` to its tokenizer_config.json, or use format: {plain}.")


def tool_features(msgs: list[dict], tools) -> list[str]:
    """Which chat_template.TOOL_PROBES features a conversation uses."""
    return [f for f, used in (("tools", bool(tools)), ("tool calls", any(m.get("tool_calls") for m in msgs)),
                              ("tool replies", any(m["role"] == "tool" for m in msgs))) if used]


class ChatRenderer:
    """`apply_chat_template(..., tokenize=False)`, faster, with a self-check against the original."""

    def __init__(self, tok, name: str | None = None):
        self.tok = tok
        self.name = name or getattr(tok, "name_or_path", None) or "the tokenizer"  # for messages
        self._fast = None
        self._checked: set = set()
        self._support: dict | None = None
        self._call_form = CALL_FORMS[0]  # the form this template renders tool calls in (tool_support finds it)
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._fast = _compile_jinja_template(tok.chat_template)
            self._kw = dict(tok.special_tokens_map)
        except Exception:  # noqa: BLE001 - private API; the slow path is always correct
            self._fast = None

    def _slow(self, msgs, gen, tools=None):
        return self.tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    def __call__(self, msgs: list[dict], gen: bool, tools: list | None = None) -> str:
        return self._render(self.in_form(msgs), gen, tools)

    def in_form(self, msgs: list[dict]) -> list[dict]:
        """The conversation as this template accepts it: its tool-call turns in the template's CallForm."""
        if any(m.get("tool_calls") for m in msgs):
            self.tool_support()
        return in_form(msgs, self._call_form)

    def _render(self, msgs: list[dict], gen: bool, tools: list | None = None) -> str:
        if self._fast is not None:
            try:
                text = self._fast.render(messages=msgs, tools=tools, documents=None, add_generation_prompt=gen,
                                         **self._kw)
            except Exception:  # noqa: BLE001 - e.g. the template's raise_exception(); the slow path reports it
                text = None
            if text is not None:
                kind = tools is not None  # checked once without tools and once with
                if kind in self._checked:
                    return text
                self._checked.add(kind)
                if text == self._slow(msgs, gen, tools):
                    return text
                self._fast = None  # differs from apply_chat_template: always use the original from now on
        return self._slow(msgs, gen, tools)

    def tool_support(self) -> dict:
        """feature -> None if the template renders it, else why not (probed once, chat_template.tool_support); the
        CallForm its tool calls render in becomes the form this renderer gives the template."""
        if self._support is None:
            self._support, self._call_form = tool_support(self.tok, self._render)
        return self._support

    def require(self, features: list[str], where: str) -> None:
        for f in features:
            why = self.tool_support()[f]
            if why is not None:
                raise BadSample(where, f"this conversation has {f}, but the chat template of {self.name} does not "
                                       f"render them ({why}), so they cannot be trained.",
                                "set model.tokenizer to a tokenizer whose chat template renders tools (an Instruct "
                                "model's own, e.g. Llama-3.1-8B-Instruct's, or Qwen3's: assets/tokenizer/qwen3), or "
                                "remove the tool turns from the data.")


def assistant_spans(render, msgs: list[dict], loss_on: str, where: str,
                    tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    try:
        return _assistant_spans(render, msgs, loss_on, where, tools)
    except BadSample:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError from raise_exception() and friends
        raise BadSample(where, f"the chat template rejected this conversation ({type(e).__name__}: {e}).",
                        "make the conversation fit the template (e.g. alternating user/assistant turns) "
                        "or use a tokenizer whose template accepts it.") from None


def _assistant_spans(render, msgs: list[dict], loss_on: str, where: str,
                     tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
    needs = tool_features(msgs, tools)
    if needs:
        render.require(needs, where)
    full = render(msgs, False, tools)
    spans = []
    idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        idx = idx[-1:]
    idx = [i for i in idx if msgs[i].get("weight", 1) != 0]  # OpenAI's "weight": 0 = no loss on that turn
    if not idx:
        raise BadSample(where, f"no assistant turn carries labels (loss_on: {loss_on}; a turn with weight 0 has "
                               "none), so the conversation's loss would be 0/0 = NaN.",
                        "give that turn weight 1, set data.loss_on: all_assistant, or remove the row.")
    for i in idx:
        start_text = render(msgs[:i], True, tools) if i else ""
        end_text = render(msgs[: i + 1], False, tools)
        if full.startswith(start_text) and full.startswith(end_text) and len(end_text) > len(start_text):
            end = len(end_text)
        else:
            end = _history_end(full, start_text, end_text, msgs[i])
            if end is None:
                raise BadSample(where, "the chat template does not render conversations prefix by prefix, "
                                       "so assistant tokens cannot be located.",
                                "use a template where rendering messages[:i] is a prefix of the full rendering.")
        if msgs[i].get("truncated"):
            # a reply cut off mid-way (data.replay at max_new_tokens): its text is trained, the template's
            # end-of-turn after it is not, or the model would learn to stop where the cut fell
            at = full.find(msgs[i]["content"], len(start_text), end)
            if at < 0:
                raise BadSample(where, f"message {i} is marked truncated, but the chat template changes its text, "
                                       "so where the reply ends cannot be found.",
                                "remove 'truncated', or strip the reply's surrounding whitespace.")
            end = at + len(msgs[i]["content"])
        spans.append((len(start_text), end))
    return full, spans


def _history_end(full: str, start_text: str, end_text: str, msg: dict) -> int | None:
    """Where assistant turn i ends in `full` when the template renders a turn differently once later messages
    follow it (Qwen3: the last assistant turn after the last user query gets '<think>\n\n</think>\n\n' before
    its content or its tool calls, earlier turns do not; families.py). The turn starts where the generation prompt
    ends (that part must still be a prefix); in the history form it is the last-turn rendering less some of what
    that put before the turn's anchor (its reply text, or the name its first tool call calls), and it ends with the
    same end-of-turn text. None when the turn cannot be located that way."""
    content = msg.get("content")
    if isinstance(content, str) and "</think>" in content:
        # a reply that carries its reasoning: Qwen3's template renders only the text after '</think>' (leading
        # newlines dropped) once later messages follow, and reformats the block in the last-turn form
        content = content.rsplit("</think>", 1)[1].lstrip("\n")
        if not content:
            return None
    calls = msg.get("tool_calls") or [{}]
    anchor = content if isinstance(content, str) and content else calls[0].get("function", {}).get("name")
    if not anchor or not full.startswith(start_text):
        return None
    turn = end_text[len(start_text):]
    cut = turn.rfind(anchor)
    for lead in range(1, cut + 1):  # the longest part of the turn that follows the generation prompt in `full`
        if full.startswith(turn[lead:], len(start_text)):
            return len(start_text) + len(turn) - lead
    return None


def labels_from_offsets(ids, offsets, spans) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int32)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    s, e = off[:, 0], off[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        # A token that straddles the start (e.g. " b" after a prompt ending in "ASSISTANT: ") carries the
        # first reply characters: it is a label, else the reply's first token would never be learned.
        mask |= (e > a) & (e <= b) & (e > s)
    return np.where(mask, ids, IGNORE).astype(np.int32)


def encode_chat(tok, msgs: list[dict], loss_on: str, where: str, render=None,
                tools: list | None = None) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(render or ChatRenderer(tok), msgs, loss_on, where, tools)
    enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
    return list(enc.ids), labels_from_offsets(enc.ids, enc.offsets, spans).tolist()


def _text_ids(tok, body_ids) -> np.ndarray:
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(body_ids)
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int32)


def _text_labels(ids: np.ndarray) -> np.ndarray:
    labels = ids.copy()
    labels[0] = IGNORE  # nothing predicts the first token of a document (no leak across packed documents)
    return labels


def encode_text(tok, text: str) -> tuple[list[int], list[int]]:
    ids = _text_ids(tok, tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)
    return ids.tolist(), _text_labels(ids).tolist()


def encode_batch(tok, render, items: list[tuple[str, object, str, list | None]]) -> list:
    """items: (where, messages-or-text-or-Pair, loss_on, tools) -> per item (ids int32, labels int32), for a Pair
    ((chosen ids, labels), (rejected ids, labels)), or a BadSample. A pair's two conversations are its prompt followed
    by each completion; the prompt's assistant turns carry weight 0 (formats.Pair), so only completions are labels."""
    out: list = [None] * len(items)
    texts, meta = [], []
    for k, (where, conv, loss_on, tools) in enumerate(items):
        if isinstance(conv, str):
            texts.append(conv)
            meta.append((k, None))
            continue
        convs = [conv.prompt + conv.chosen, conv.prompt + conv.rejected] if isinstance(conv, Pair) else [conv]
        try:
            rendered = [assistant_spans(render, c, loss_on, where, tools) for c in convs]
        except BadSample as e:
            out[k] = e
            continue
        for text, spans in rendered:
            texts.append(text)
            meta.append((k, spans))
    encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    for (k, spans), enc in zip(meta, encs):
        if spans is None:
            ids = _text_ids(tok, enc.ids)
            doc = (ids, _text_labels(ids))
        else:
            doc = (np.asarray(enc.ids, dtype=np.int32), labels_from_offsets(enc.ids, enc.offsets, spans))
        if isinstance(items[k][1], Pair):  # chosen first, then rejected
            out[k] = (doc,) if out[k] is None else (out[k][0], doc)
        else:
            out[k] = doc
    return out
