"""Chat template rendering with assistant-only labels.

The tokenizer's own chat template renders the conversation. Labels are found
from character spans: the text rendered for messages[:i] plus the generation
prompt is where assistant turn i starts, the text for messages[:i+1] is where it
ends (its end-of-turn token included). One tokenization with offsets then maps
spans to tokens. This works for any template with the prefix property, which
is checked per sample rather than assumed.
"""

from __future__ import annotations

from .sources import BadSample

IGNORE = -100


class TemplateError(ValueError):
    pass


def require_chat_template(tok, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"tokenizer {where} has no chat template, so chat data cannot be rendered. "
                            "Use a tokenizer with one (e.g. the Instruct model's) or the 'text' format.")


def _render(tok, msgs, gen: bool) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def assistant_spans(tok, msgs: list[dict], loss_on: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    full = _render(tok, msgs, gen=False)
    spans = []
    idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        idx = idx[-1:]
    for i in idx:
        start_text = _render(tok, msgs[:i], gen=True) if i else ""
        end_text = _render(tok, msgs[: i + 1], gen=False)
        if not (full.startswith(start_text) and full.startswith(end_text)):
            raise BadSample(where, "the chat template does not render conversations prefix by prefix, "
                                   "so assistant tokens cannot be located.",
                            "use a template where rendering messages[:i] is a prefix of the full rendering.")
        spans.append((len(start_text), len(end_text)))
    return full, spans


def encode_chat(tok, msgs: list[dict], loss_on: str, where: str) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(tok, msgs, loss_on, where)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = [IGNORE] * len(ids)
    for a, b in spans:
        for t, (s, e) in enumerate(offsets):
            if s >= a and e <= b and e > s:
                labels[t] = ids[t]
    return ids, labels


def encode_text(tok, text: str) -> tuple[list[int], list[int]]:
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids += tok(text, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    labels = list(ids)
    labels[0] = IGNORE  # nothing predicts the first token of a document (no leak across packed documents)
    return ids, labels
