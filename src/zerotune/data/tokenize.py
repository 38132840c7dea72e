"""Chat template rendering with assistant-only labels.

The tokenizer's own chat template renders the conversation. Labels are found
from character spans: the text rendered for messages[:i] plus the generation
prompt is where assistant turn i starts, the text for messages[:i+1] is where it
ends (its end-of-turn token included). One tokenization with offsets then maps
spans to tokens: a token is a label when it ends inside a span (so a token that
merges the prompt's trailing space with the reply's first word is a label). This
works for any template with the prefix property, which is checked per sample
rather than assumed. The ids are exactly those of
`tok.apply_chat_template(messages, tokenize=True)` (tests check it).

Speed: the compiled Jinja template is called directly (about 3x cheaper than
`apply_chat_template`, verified equal on the first conversation of every
process, else we fall back), and a chunk of samples is tokenized with one
`encode_batch` call.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from .sources import BadSample

IGNORE = -100


class TemplateError(UserError, ValueError):
    pass


def require_chat_template(tok, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"tokenizer {where} has no chat template, so chat data (formats messages, instruction, "
                            "prompt_completion) cannot be rendered. Fix: use a tokenizer that has one (e.g. the "
                            "Instruct model's), add `chat_template` to its tokenizer_config.json, or use format: text.")


class ChatRenderer:
    """`apply_chat_template(..., tokenize=False)`, faster, with a self-check against the original."""

    def __init__(self, tok):
        self.tok = tok
        self._fast = None
        self._checked = False
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._fast = _compile_jinja_template(tok.chat_template)
            self._kw = dict(tok.special_tokens_map)
        except Exception:  # noqa: BLE001 - private API; the slow path is always correct
            self._fast = None

    def _slow(self, msgs, gen):
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def __call__(self, msgs: list[dict], gen: bool) -> str:
        if self._fast is not None:
            try:
                text = self._fast.render(messages=msgs, add_generation_prompt=gen, **self._kw)
            except Exception:  # noqa: BLE001 - e.g. the template's raise_exception(); the slow path reports it
                text = None
            if text is not None:
                if self._checked:
                    return text
                self._checked = True
                if text == self._slow(msgs, gen):
                    return text
                self._fast = None  # differs from apply_chat_template: always use the original from now on
        return self._slow(msgs, gen)


def assistant_spans(render, msgs: list[dict], loss_on: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    try:
        return _assistant_spans(render, msgs, loss_on, where)
    except BadSample:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError from raise_exception() and friends
        raise BadSample(where, f"the chat template rejected this conversation ({type(e).__name__}: {e}).",
                        "make the conversation fit the template (e.g. alternating user/assistant turns) "
                        "or use a tokenizer whose template accepts it.") from None


def _assistant_spans(render, msgs: list[dict], loss_on: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    full = render(msgs, False)
    spans = []
    idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        idx = idx[-1:]
    for i in idx:
        start_text = render(msgs[:i], True) if i else ""
        end_text = render(msgs[: i + 1], False)
        if not (full.startswith(start_text) and full.startswith(end_text) and len(end_text) > len(start_text)):
            raise BadSample(where, "the chat template does not render conversations prefix by prefix, "
                                   "so assistant tokens cannot be located.",
                            "use a template where rendering messages[:i] is a prefix of the full rendering.")
        spans.append((len(start_text), len(end_text)))
    return full, spans


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


def encode_chat(tok, msgs: list[dict], loss_on: str, where: str, render=None) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(render or ChatRenderer(tok), msgs, loss_on, where)
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


def encode_batch(tok, render, items: list[tuple[str, object, str]]) -> list:
    """items: (where, messages-or-text, loss_on) -> per item (ids int32, labels int32) or a BadSample."""
    out: list = [None] * len(items)
    texts, meta = [], []
    for k, (where, conv, loss_on) in enumerate(items):
        if isinstance(conv, str):
            texts.append(conv)
            meta.append((k, None))
            continue
        try:
            text, spans = assistant_spans(render, conv, loss_on, where)
        except BadSample as e:
            out[k] = e
            continue
        texts.append(text)
        meta.append((k, spans))
    encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    for (k, spans), enc in zip(meta, encs):
        if spans is None:
            ids = _text_ids(tok, enc.ids)
            out[k] = (ids, _text_labels(ids))
        else:
            out[k] = (np.asarray(enc.ids, dtype=np.int32), labels_from_offsets(enc.ids, enc.offsets, spans))
    return out
