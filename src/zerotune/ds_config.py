"""Build the DeepSpeed config: the shipped JSON plus the recipe's `train.zero` overrides."""

from __future__ import annotations

import copy
import json

from .config import Recipe, resolve_path
from .errors import MissingInputError, UserError


def build(r: Recipe) -> dict | None:
    if r.train.deepspeed is None:
        return None
    path = resolve_path(r.train.deepspeed)
    if not path.exists():
        raise MissingInputError(f"train.deepspeed: {path} not found; use a shipped config from configs/deepspeed/ "
                                f"(e.g. train.deepspeed=configs/deepspeed/zero3.json) or null for no DeepSpeed.")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"train.deepspeed: {path} line {e.lineno}: not valid JSON ({e.msg}).") from None
    zero = copy.deepcopy(cfg.get("zero_optimization", {}))
    for key, value in r.train.zero.items():
        if isinstance(value, dict) and isinstance(zero.get(key), dict):
            zero[key] = {**zero[key], **value}
        else:
            zero[key] = value
    cfg["zero_optimization"] = zero
    return cfg
