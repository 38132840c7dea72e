"""`zerotune prepare RECIPE`: data -> tokenized, labelled, packed Arrow + manifest.

Runs once, before any distributed launch (tokenizing under a NCCL barrier times
out on large data, LLaMA-Factory #2424). A fingerprint of sources, tokenizer,
chat template, the recipe's data section and library versions decides whether
the cache can be reused; training refuses a missing or stale cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import manifest as mf
from ..config import Recipe, resolve_path
from .formats import to_messages
from .packing import pack
from .sources import BadSample, mixture
from .tokenize import IGNORE, encode_chat, encode_text, require_chat_template

FORMAT_VERSION = 1  # bump when the on-disk layout or labelling rules change


class StaleDataError(RuntimeError):
    pass


def data_dir(r: Recipe) -> Path:
    return r.out / "data"


def load_tokenizer(r: Recipe):
    from transformers import AutoTokenizer

    path = resolve_path(r.model.tokenizer)
    src = str(path) if path is not None and path.exists() else r.model.tokenizer
    if path is not None and not path.exists() and r.model.tokenizer.startswith(("assets/", "/", ".")):
        raise FileNotFoundError(f"tokenizer folder {path} not found. Run `make setup` (it fetches the Llama-3.1 tokenizer).")
    tok = AutoTokenizer.from_pretrained(src)
    if tok.pad_token_id is None:
        # Llama-3 has no pad token; padding is always label-masked, so any id works. Use the
        # reserved token rather than EOS so padding is visible as such in a decoded batch.
        reserved = tok.convert_tokens_to_ids("<|finetune_right_pad_id|>")
        tok.pad_token_id = reserved if isinstance(reserved, int) and reserved != tok.unk_token_id else tok.eos_token_id
    return tok


def fingerprint(r: Recipe, tok) -> dict:
    import datasets
    import tokenizers
    import transformers

    sources = []
    for s in r.data.sources:
        p = resolve_path(s.path)
        sources.append({"path": s.path, "sha256": mf.sha256(p)} if p is not None and p.exists()
                       else {"hub": s.path, "name": s.name, "split": s.split, "revision": s.revision})
    parts = {
        "format_version": FORMAT_VERSION,
        "sources": sources,
        "tokenizer_vocab": hashlib.sha256(json.dumps(tok.get_vocab(), sort_keys=True).encode()).hexdigest(),
        "chat_template": hashlib.sha256((tok.chat_template or "").encode()).hexdigest(),
        "data_section": {k: v for k, v in r.to_dict()["data"].items() if k not in ("num_proc", "heldout")},
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "datasets": datasets.__version__},
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "inputs": parts}


_TOK = None


def _init_worker(tok_path):
    global _TOK
    from transformers import AutoTokenizer
    _TOK = AutoTokenizer.from_pretrained(tok_path) if isinstance(tok_path, str) else tok_path


def _encode(job):
    """(where, fmt, columns, row, loss_on) -> (where, ids, labels) or (where, BadSample)."""
    where, fmt, columns, row, loss_on = job
    try:
        conv = to_messages(row, fmt, columns, where)
        if isinstance(conv, str):
            return where, encode_text(_TOK, conv)
        return where, encode_chat(_TOK, conv, loss_on, where)
    except BadSample as e:
        return where, e


def _percentiles(lengths: list[int]) -> dict:
    if not lengths:
        return {}
    q = np.percentile(lengths, [0, 50, 90, 99, 100])
    return {k: int(v) for k, v in zip(["min", "p50", "p90", "p99", "max"], q)}


def tokenize_all(r: Recipe, tok) -> tuple[list, dict]:
    counts = {"rows_in": 0, "bad_skipped": 0, "truncated": 0, "dropped_overlong": 0, "docs_out": 0}
    bad_examples: list[str] = []
    jobs = []
    for row in mixture(r.data.sources, r.data.seed):
        counts["rows_in"] += 1
        src = r.data.sources[row.source]
        if row.error is not None:
            jobs.append((row.where, None, None, row.error, None))
        else:
            jobs.append((row.where, src.format, src.columns, row.data, r.data.loss_on))
    docs = []
    if r.data.num_proc > 1:
        pool = Pool(r.data.num_proc, initializer=_init_worker, initargs=(tok.name_or_path,))
        results = pool.imap(_encode_or_error, jobs, chunksize=256)
    else:
        _init_worker(tok)
        pool, results = None, map(_encode_or_error, jobs)
    try:
        for where, res in tqdm(results, total=len(jobs), desc="tokenize", unit="row", mininterval=2,
                               disable=None):
            if isinstance(res, BadSample):
                if r.data.on_bad_sample == "error":
                    raise res
                counts["bad_skipped"] += 1
                if len(bad_examples) < 20:
                    bad_examples.append(str(res))
                continue
            ids, labels = res
            if len(ids) > r.data.seq_len:
                if r.data.overlong == "drop":
                    counts["dropped_overlong"] += 1
                    continue
                counts["truncated"] += 1
                ids, labels = ids[: r.data.seq_len], labels[: r.data.seq_len]
            if not any(x != IGNORE for x in labels):
                # Truncation removed every label token: a 0/0 loss. Counted, never kept.
                counts["dropped_no_labels"] = counts.get("dropped_no_labels", 0) + 1
                continue
            docs.append((ids, labels))
    finally:
        if pool is not None:
            pool.terminate()
    counts["docs_out"] = len(docs)
    return docs, {"counts": counts, "bad_examples": bad_examples}


def _encode_or_error(job):
    where, fmt, columns, row, loss_on = job
    if isinstance(row, BadSample):
        return where, row
    return _encode(job)


def _split_eval(docs, frac: float, seed: int):
    if frac <= 0:
        return docs, []
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(docs))
    n_eval = max(1, int(round(frac * len(docs))))
    ev = set(idx[:n_eval].tolist())
    return [d for i, d in enumerate(docs) if i not in ev], [d for i, d in enumerate(docs) if i in ev]


def _rows(docs, r: Recipe, pad_id: int):
    if r.data.packing:
        return pack(docs, r.data.seq_len, pad_id)
    return [{"input_ids": ids, "labels": lab, "position_ids": list(range(len(ids)))} for ids, lab in docs], 0


def _histogram(lengths: list[int], seq_len: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist(lengths, bins=50, color="#4477aa")
    ax.axvline(seq_len, color="#cc3311", ls="--", label=f"seq_len {seq_len}")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    ax.set_title("Document lengths after tokenization")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prepare(r: Recipe, force: bool = False) -> dict:
    from datasets import Dataset

    if not r.data.sources:
        raise ValueError(f"recipe {r.name}: data.sources is empty; list at least one file or hub data set.")
    tok = load_tokenizer(r)
    if any(s.format != "text" for s in r.data.sources):
        require_chat_template(tok, r.model.tokenizer)
    fp = fingerprint(r, tok)
    out = data_dir(r)
    old = mf.read(out / "manifest.json")
    if not force and old and old.get("fingerprint") == fp["fingerprint"] and (out / "train").exists():
        print(f"prepare: cache hit ({out}, fingerprint {fp['fingerprint']}); nothing to do")
        return old

    docs, info = tokenize_all(r, tok)
    if not docs:
        raise ValueError(f"recipe {r.name}: no usable samples after preparation ({info['counts']}).")
    train_docs, eval_docs = _split_eval(docs, r.data.eval_fraction, r.data.seed)
    train_rows, train_pad = _rows(train_docs, r, tok.pad_token_id)
    eval_rows, _ = _rows(eval_docs, r, tok.pad_token_id)

    # Write next to the old cache and swap at the end: a failure leaves the old cache intact.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    Dataset.from_list(train_rows).save_to_disk(str(tmp / "train"))
    if eval_rows:
        Dataset.from_list(eval_rows).save_to_disk(str(tmp / "eval"))
    lengths = [len(d[0]) for d in docs]
    label_tokens = sum(sum(1 for x in d[1] if x != IGNORE) for d in train_docs)
    real_tokens = sum(len(d[0]) for d in train_docs)
    total_tokens = sum(len(x["input_ids"]) for x in train_rows)
    manifest = {
        "stage": "prepare",
        "recipe": r.name,
        **fp,
        **info,
        "sequences": {"train": len(train_rows), "eval": len(eval_rows)},
        "tokens": {"train_real": real_tokens, "train_total": total_tokens, "train_label": label_tokens,
                   "padding": train_pad if r.data.packing else None},
        "packing": {"enabled": r.data.packing, "seq_len": r.data.seq_len,
                    "efficiency": round(real_tokens / total_tokens, 4) if r.data.packing else None},
        "doc_length": _percentiles(lengths),
        "pad_token_id": tok.pad_token_id,
    }
    _histogram(lengths, r.data.seq_len, tmp / "lengths.png")
    mf.write(tmp / "manifest.json", manifest)
    mf.write_resolved_recipe(tmp, r)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    c = info["counts"]
    print(f"prepare: {c['rows_in']} rows -> {c['docs_out']} documents ({c['bad_skipped']} bad skipped, "
          f"{c['truncated']} truncated, {c['dropped_overlong']} dropped) -> {len(train_rows)} train / "
          f"{len(eval_rows)} eval sequences of <= {r.data.seq_len} tokens; {label_tokens:,} label tokens; "
          f"packing efficiency {manifest['packing']['efficiency']}; wrote {out}")
    return manifest


def require_prepared(r: Recipe) -> dict:
    """The manifest of a cache that matches the recipe, or a clear error."""
    out = data_dir(r)
    m = mf.read(out / "manifest.json")
    if not m or not (out / "train").exists():
        raise StaleDataError(f"no prepared data in {out}. Run `make data RECIPE={r.name}` first "
                             "(data is prepared once, before launching training).")
    fp = fingerprint(r, load_tokenizer(r))["fingerprint"]
    if m.get("fingerprint") != fp:
        raise StaleDataError(f"prepared data in {out} is stale (fingerprint {m.get('fingerprint')} != {fp}: the sources, "
                             f"tokenizer or data section changed). Run `make data RECIPE={r.name}` again.")
    return m
