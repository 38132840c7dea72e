"""How a recipe's fields are declared and read, whatever the sections (config.py states those): `setting` (a
dataclass field with its help text and the values it takes, a `Bound`), `build` (a YAML mapping -> a section's
dataclass: unknown keys refused with a suggestion, each value coerced to its declared type, bounds checked) and
`read_yaml` (a recipe file -> its mapping, a key given twice refused, every YAML error one line).

Values are coerced because PyYAML reads `lr: 2e-5` as the string '2e-5'.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import UserError, why_unreadable


class RecipeError(UserError, ValueError):
    """A recipe or override is invalid; the message says where and what to do."""


@dataclass(frozen=True)
class Bound:
    """The values a numeric field takes, stated on the field: checked when a recipe loads (one line naming the
    key, never a crash or a silently different run later: a warmup_ratio of 3 would be 3 steps to transformers)
    and printed by `zerotune explain`."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:
        return ((self.lo is None or (v > self.lo if self.lo_open else v >= self.lo))
                and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)))

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


POSITIVE, AT_LEAST_1, NON_NEGATIVE = Bound(0, lo_open=True), Bound(1), Bound(0)
FRACTION, FRACTION_BELOW_1 = Bound(0, 1), Bound(0, 1, hi_open=True)
GPU_LAYERS = Bound(-1)  # -1 = every layer


def setting(default, help: str, valid: Bound | None = None, **kw):
    """A schema field: its default (a list or dict copied per recipe), its help for `zerotune explain`, and the
    values it takes, checked by `build`."""
    meta = {"help": help, "valid": valid}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def help_of(f: dataclasses.Field) -> str:
    """A field's help text as `zerotune explain` prints it, with its valid values."""
    valid = f.metadata.get("valid")
    return f.metadata.get("help", "") + (f" ({valid})" if valid else "")


def suggest(key: str, options) -> str:
    """The end of an error that names a key not among `options`: the closest one, or all of them."""
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


def coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` as the declared type `tp` (Optional, Literal, a typed sub-section, bool/int/float/str/dict/list)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return coerce(value, inner[0], where)
    if dataclasses.is_dataclass(tp):  # a typed sub-section (data.replay): its own keys, checked the same way
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            value = yaml.safe_load(value)
        return build(tp, value, where)
    if origin is Literal:
        sval = value if not isinstance(value, bool) else ("on" if value else "off")
        if sval not in args:
            raise RecipeError(f"{where}: '{value}' is not one of {list(args)}.{suggest(str(value), args)}")
        return sval
    if tp is str and value is None:  # `output_dir=` or a bare `key:` would otherwise be the text 'None'
        raise RecipeError(f"{where}: empty; give it a value, or remove the key for its default.")
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            f = float(value)
            if f != int(f):
                raise ValueError
            return int(f)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if tp in (dict, list):
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if not isinstance(value, tp):
                raise ValueError
            return value
    except (TypeError, ValueError):
        raise RecipeError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}.") from None
    return value


def build(cls, raw: dict, where: str):
    """A section's dataclass from its YAML mapping; `where` starts every error message."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping, got {raw!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise RecipeError(f"{where}: unknown key '{key}'.{suggest(key, fields)}")
        kwargs[key] = coerce(value, hints[key], f"{where}.{key}")
        bound = fields[key].metadata.get("valid")
        if bound is not None and kwargs[key] is not None and kwargs[key] not in bound:
            raise RecipeError(f"{where}.{key}={kwargs[key]!r}: must be {bound}.")
    return cls(**kwargs)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word: a recipe with `model:` twice trains on half of it."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):  # PyYAML's own error follows
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in this mapping; "
                                                        f"keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict:
    """A recipe file's mapping of sections; a file that is not one is a RecipeError of one line."""
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as e:  # one line: the file, the line, PyYAML's problem
        mark = getattr(e, "problem_mark", None)
        raise RecipeError(f"{path}{f' line {mark.line + 1}' if mark else ''}: not valid YAML: "
                          f"{getattr(e, 'problem', None) or e}.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot be read as a recipe ({why_unreadable(e)}).") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping of sections (model:, data:, train:, ...), not a "
                          f"{type(raw).__name__}.")
    return raw
