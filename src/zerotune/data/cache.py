"""The prepared-data cache as the other stages meet it: the recipe's tokenizer, the fingerprint that says whether
a cache still matches the recipe, and `require_prepared`, which training, inspect and the launcher call before
they read it.

The fingerprint holds everything the prepared rows depend on: the sources (sha256, or the hub id and revision),
the whole tokenizer, its special tokens and chat template, the recipe's data section, the library versions and,
with data.replay, what the base model's answers depend on. A cache whose fingerprint differs is stale: training
refuses it, naming what changed. `zerotune data` (data/prepare.py) writes the cache; this module only reads it, so
a training worker loads neither the preparer nor its tokenization and packing.
"""

from __future__ import annotations

import hashlib
import json

from .. import manifest as mf
from ..config import Recipe, resolve_path
from ..errors import MissingInputError, UserError
from ..layout import layout
from .replay import replay_key

FORMAT_VERSION = 5  # bump when the on-disk layout or labelling rules change (3: "truncated" assistant turns;
# 4: per-turn weight, tools and tool calls, ShareGPT; 5: tool-call turns in the form each template accepts)


class StaleDataError(UserError, RuntimeError):
    pass


_TOKENIZERS: dict = {}


def load_tokenizer(r: Recipe):
    """The recipe's tokenizer (cached per process while its local files are unchanged)."""
    from transformers import AutoTokenizer

    path = resolve_path(r.model.tokenizer)
    src = str(path) if path is not None and path.exists() else r.model.tokenizer
    if path is not None and not path.exists() and r.model.tokenizer.startswith(("assets/", "/", ".")):
        raise MissingInputError(f"model.tokenizer: folder {path} not found. Run `make setup` (it fetches the Llama-3.1 tokenizer).")
    key = (src, tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in path.iterdir() if f.is_file()))
           if path is not None and path.is_dir() else None)
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:  # transformers' own "can't load" errors: a folder without tokenizer files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.tokenizer: no tokenizer loads from {src} ({first[:200]}). Point it at a folder with "
                        f"tokenizer.json and tokenizer_config.json, or a hub id (`make setup` fetches the shipped "
                        f"ones into assets/tokenizer/).") from None
    if not getattr(tok, "is_fast", False):
        raise UserError(f"model.tokenizer: {src} has no fast (Rust) implementation; prepare needs character offsets. "
                         "Fix: provide a tokenizer.json.")
    if tok.pad_token_id is None:
        # Llama-3 has no pad token; padding is always label-masked, so any id works. Use the
        # reserved token rather than EOS so padding is visible as such in a decoded batch.
        reserved = tok.convert_tokens_to_ids("<|finetune_right_pad_id|>")
        tok.pad_token_id = reserved if isinstance(reserved, int) and reserved != tok.unk_token_id else tok.eos_token_id
    if len(_TOKENIZERS) > 4:
        _TOKENIZERS.clear()
    _TOKENIZERS[key] = tok
    return tok


def _tokenizer_hash(tok) -> str:
    h = getattr(tok, "_zerotune_hash", None)
    if h is None:
        h = hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
        tok._zerotune_hash = h
    return h


def fingerprint(r: Recipe, tok) -> dict:
    import datasets
    import tokenizers
    import transformers

    sources = []
    for s in r.data.sources:
        p = resolve_path(s.path)
        sources.append({"path": s.path, "sha256": mf.sha256(p)} if p is not None and p.is_file()
                       else {"hub": s.path, "name": s.name, "split": s.split, "revision": s.revision})
    parts = {
        "format_version": FORMAT_VERSION,
        "sources": sources,
        # the whole Rust tokenizer (vocab, merges, normalizer, pre-tokenizer, added tokens)
        "tokenizer": _tokenizer_hash(tok),
        "special_tokens": {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id},
        "chat_template": hashlib.sha256((tok.chat_template or "").encode()).hexdigest(),
        "data_section": {k: v for k, v in r.to_dict()["data"].items() if k not in ("num_proc", "heldout")},
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "datasets": datasets.__version__},
    }
    if r.data.replay:  # what its answers depend on (weights, prompts, template): other answers, other data
        parts["replay"] = replay_key(r, tok)["inputs"]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "inputs": parts}


def _flatten(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: []}
    return {prefix: obj}


def fingerprint_diff(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old or {}), _flatten(new or {})
    return sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))


def require_prepared(r: Recipe) -> dict:
    """The manifest of a cache that matches the recipe, or a clear error."""
    paths = layout(r)
    out = paths.data
    m = mf.read(paths.data_manifest)
    if not m or not paths.data_train.exists():
        raise StaleDataError(f"no prepared data in {out}. Run `make data RECIPE={r.name}` "
                             f"first: data is prepared once, before "
                             "launching training.")
    fp = fingerprint(r, load_tokenizer(r))
    if m.get("fingerprint") != fp["fingerprint"]:
        changed = fingerprint_diff(m.get("inputs", {}), fp["inputs"])
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise StaleDataError(f"prepared data in {out} is stale (fingerprint {m.get('fingerprint')} != "
                             f"{fp['fingerprint']}; changed: {shown or 'unknown'}). The sources, tokenizer or data "
                             f"section changed since it was prepared. Run `make data RECIPE={r.name}` again.")
    return m
