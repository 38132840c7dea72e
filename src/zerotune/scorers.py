"""Scorers: how one model answer is compared with one held-out row's reference. One table, `SCORERS`.

A held-out row is `{"messages": [chat prompt], "answer": "reference"}` (or a list of acceptable references) (+ optional `"pattern"` for `regex`).
Every scorer returns a float in [0, 1]; they are all 0/1 today, the range leaves room for partial credit.
`config.py` derives the recipe's allowed `eval.sets[].scorer` names from this table, so a new scorer needs
no second edit there.

A scorer that asks for an output format (JSON) also defines what leakage of that format looks like in answers
to other sets: `FORMATS`, `leak_test`.
"""

from __future__ import annotations

import json
import math
import re
import string
from typing import Callable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
# Signed integers, decimals, exponents and thousands separators ("1,234.5"); the separators are dropped.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?")


def normalize(text: str) -> str:
    """SQuAD-style: lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def _numbers(text: str) -> list[float]:
    out = []
    for m in _NUMBER.finditer(text):
        s = m.group(0).replace(",", "")
        if any(c.isdigit() for c in s):
            try:
                out.append(float(s))
            except ValueError:  # a lone exponent fragment such as "e5"
                pass
    return out


_FENCE_OPEN = r"```(?:json)?\s*"


def _json(text: str):
    """The parsed JSON value, or a sentinel when it does not parse. A ```json fence around it is allowed:
    chat models add one unprompted, and the content is what the task asks for."""
    s = text.strip()
    fence = re.fullmatch(_FENCE_OPEN + r"(.*?)\s*```", s, re.S)
    if fence:
        s = fence.group(1)
    try:
        return json.loads(s)
    except (ValueError, TypeError):
        return _INVALID


_INVALID = object()


def exact(prediction: str, row: dict) -> float:
    return float(prediction.strip() == str(row["answer"]).strip())


def normalized(prediction: str, row: dict) -> float:
    return float(normalize(prediction) == normalize(str(row["answer"])))


def contains(prediction: str, row: dict) -> float:
    ref = normalize(str(row["answer"]))
    # Whole-word containment: "4" must not hit "14", "cat" must not hit "concatenate".
    return float(bool(ref) and f" {ref} " in f" {normalize(prediction)} ")


def regex(prediction: str, row: dict) -> float:
    pattern = row.get("pattern")
    if not pattern:
        raise ValueError("scorer 'regex' needs a pattern: set eval.sets[].pattern in the recipe or a per-row "
                         "'pattern' in the JSONL (group 1 is the extracted answer).")
    m = re.search(pattern, prediction, re.S)
    if m is None:
        return 0.0
    got = m.group(1) if m.re.groups >= 1 else m.group(0)
    return float(got is not None and normalize(got) == normalize(str(row["answer"])))


def numeric(prediction: str, row: dict) -> float:
    got, ref = _numbers(prediction), _numbers(str(row["answer"]))
    if not got or not ref:
        return 0.0
    a, b = got[-1], ref[-1]  # the last number: chain-of-thought answers end with the result
    return float(math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0 if b else 1e-12))


def json_valid(prediction: str, row: dict) -> float:
    return float(_json(prediction) is not _INVALID)


def json_fields(prediction: str, row: dict) -> float:
    got, ref = _json(prediction), _json(str(row["answer"]))
    if not isinstance(ref, dict):
        raise ValueError(f"scorer 'json_fields' needs each answer to be a JSON object; got {row['answer']!r}.")
    if not isinstance(got, dict):
        return 0.0
    return float(all(k in got and got[k] == v for k, v in ref.items()))


def json_field_share(prediction: str, row: dict) -> float:
    """json_fields with partial credit: the share of the reference's fields the prediction gets right (a GRPO
    reward that tells a record with one wrong field from a record with none right)."""
    got, ref = _json(prediction), _json(str(row["answer"]))
    if not isinstance(ref, dict):
        raise ValueError(f"scorer 'json_field_share' needs each answer to be a JSON object; got {row['answer']!r}.")
    if not isinstance(got, dict) or not ref:
        return float(isinstance(got, dict) and got == ref)
    return sum(k in got and got[k] == v for k, v in ref.items()) / len(ref)


SCORERS: dict[str, Callable[[str, dict], float]] = {
    "exact": exact,
    "normalized": normalized,
    "contains": contains,
    "regex": regex,
    "numeric": numeric,
    "json_valid": json_valid,
    "json_fields": json_fields,
    "json_field_share": json_field_share,
}


def score(scorer: str, prediction: str, row: dict, pattern: str | None = None) -> float:
    """Score one prediction against one row. `pattern` is the set's regex; a row's own `pattern` wins."""
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; choose one of {', '.join(SCORERS)}.")
    if pattern is not None and "pattern" not in row:
        row = {**row, "pattern": pattern}
    if isinstance(row.get("answer"), list):  # several acceptable references ("seven", "7"): the best match counts
        return max(SCORERS[scorer](prediction, {**row, "answer": a}) for a in row["answer"])
    return SCORERS[scorer](prediction, row)


def mean_score(scorer: str, predictions: list[str], rows: list[dict], pattern: str | None = None) -> float:
    return sum(score(scorer, p, r, pattern) for p, r in zip(predictions, rows)) / max(1, len(rows))


def json_shaped(prediction: str) -> bool:
    """Is this answer given as JSON, the format of a json_valid / json_fields task? It is when, a ```json fence
    (closed or not) removed, it starts with `{` or `[`. That covers every JSON object or array `_json` parses, and
    the broken ones a fine-tune leaks into unrelated answers ({"world": 7"}) or max_new_tokens cuts off.
    Not leakage: a bare JSON scalar ("7", "true": a plain answer to a plain question) and prose with braces
    later on ("a dict looks like {1: 2}"); a set's `forbid` regex catches other shapes."""
    return re.sub("^" + _FENCE_OPEN, "", prediction.strip()).startswith(("{", "["))


# The output format a task's scorer asks for, as a test of one answer. Answers to the other eval sets in this
# format are leakage: the fine-tune taught the task's format where it does not belong. Scorers that compare
# content only (exact, contains, numeric, ...) define no format.
FORMATS: dict[str, Callable[[str], bool]] = {
    "json_valid": json_shaped,
    "json_fields": json_shaped,
    "json_field_share": json_shaped,
}


def leak_test(task_scorer: str, forbid: str | None = None) -> Callable[[str], bool] | None:
    """What counts as a leaked answer in a set next to a task scored `task_scorer`: the set's own `forbid` regex
    (re.search) when it has one, which replaces the task's format (so a set whose right answers are JSON can
    forbid only the task's keys); else the task's format; None = not measured."""
    if forbid is not None:
        rx = re.compile(forbid)
        return lambda prediction: rx.search(prediction) is not None
    return FORMATS.get(task_scorer)
