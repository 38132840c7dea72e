"""`zerotune inspect RECIPE [--n N]`: what the model trains on, read back from the prepared data.

It reads the packed Arrow rows training reads (layout.data_train) and the data manifest, not the sources, so it
shows exactly what training sees: the first N sequences as text, the label tokens (the ones the loss is computed
on) highlighted, each document inside a packed row marked where its position_ids restart at 0, the padding that
fills the row, and per source the rows read, documents kept and keys ignored (manifest). A preference pair shows
its chosen and its rejected conversation, the labels on each completion. In a terminal the labels
are coloured; elsewhere (a pipe, a log file) they are wrapped in ⟦ ⟧. An HTML copy goes to
layout.inspect_html.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

from .. import manifest as mf
from ..config import Recipe
from ..layout import layout, write_resolved_recipe
from .cache import load_tokenizer, require_prepared
from .prepare import source_lines
from .tokenize import IGNORE

OPEN, CLOSE = "⟦", "⟧"  # plain-text label markers: rare in real data, so what they enclose is unambiguous
GREEN, CYAN, DIM, RESET = "\033[32m", "\033[36m", "\033[2m", "\033[0m"


def documents(ids, labels, pos, pad_id: int) -> list[dict]:
    """A prepared row split into its documents (a document starts where position_ids restart at 0), each as
    runs of consecutive label / non-label tokens; the row's trailing padding is marked as such."""
    starts = [i for i, p in enumerate(pos) if p == 0]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    docs = []
    for a, b in zip(starts, starts[1:] + [len(ids)]):
        runs, k = [], a
        while k < b:
            lab = labels[k] != IGNORE
            j = k
            while j < b and (labels[j] != IGNORE) == lab:
                j += 1
            runs.append((lab, list(ids[k:j])))
            k = j
        # packing pads a row with pad_id tokens positioned as one more, fully unlabelled document (packing.py)
        pad = b == len(ids) and a > 0 and all(x == IGNORE for x in labels[a:b]) and all(t == pad_id for t in ids[a:b])
        docs.append({"start": a, "end": b, "padding": pad, "runs": runs,
                     "labels": sum(len(r) for lab, r in runs if lab)})
    return docs


def pair_documents(row: dict, pad_id: int) -> list[dict]:
    """A preference pair's prepared row (data/prepare.py PAIR_COLUMNS) as its two conversations, chosen then
    rejected, each one document whose label runs are its completion."""
    out = []
    for name, ids, labels in (("chosen", row["input_ids"], row["labels"]),
                              ("rejected", row["rejected_input_ids"], row["rejected_labels"])):
        (doc,) = documents(ids, labels, list(range(len(ids))), pad_id)
        out.append({**doc, "name": name})
    return out


def _decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def render_text(tok, row_no: int, n_rows: int, docs: list[dict], color: bool) -> str:
    n_tok = docs[-1]["end"] if docs else 0
    real = [d for d in docs if not d["padding"]]
    pad = sum(d["end"] - d["start"] for d in docs if d["padding"])
    c = (lambda code, s: f"{code}{s}{RESET}") if color else (lambda code, s: s)
    if docs and docs[0].get("name"):  # a preference pair: chosen and rejected, labels on the completions
        out = [c(CYAN, f"== pair {row_no + 1} of {n_rows:,} ==")]
    else:
        out = [c(CYAN, f"== sequence {row_no + 1} of {n_rows:,}: {n_tok:,} tokens, {len(real)} document"
                       f"{'s' if len(real) != 1 else ''}, {sum(d['labels'] for d in real):,} label tokens, "
                       f"{pad:,} padding ==")]
    for k, d in enumerate(docs):
        if d.get("name"):
            out.append(c(CYAN, f"-- {d['name']}: {d['end']:,} tokens, {d['labels']:,} label tokens (the completion) --"))
            out.append("".join((c(GREEN, _decode(tok, ids)) if color else f"{OPEN}{_decode(tok, ids)}{CLOSE}") if lab
                               else _decode(tok, ids) for lab, ids in d["runs"]))
            continue
        if d["padding"]:
            out.append(c(DIM, f"-- padding: tokens {d['start']:,}-{d['end'] - 1:,}, {d['end'] - d['start']:,} x "
                              f"{_decode(tok, d['runs'][0][1][:1])!r}, no labels --"))
            continue
        out.append(c(CYAN, f"-- document {k + 1}: tokens {d['start']:,}-{d['end'] - 1:,} (position_ids restart at 0), "
                           f"{d['labels']:,} label tokens --"))
        text = "".join((c(GREEN, _decode(tok, ids)) if color else f"{OPEN}{_decode(tok, ids)}{CLOSE}") if lab
                       else _decode(tok, ids) for lab, ids in d["runs"])
        out.append(text)
    return "\n".join(out)


def summary_lines(r: Recipe, m: dict) -> list[str]:
    t, seqs = m["tokens"], m["sequences"]
    share = t["train_label"] / t["train_total"] if t["train_total"] else 0
    units = (f"pairs: {seqs['train']:,} train / {seqs['eval']:,} eval, a chosen and a rejected row of"
             if m.get("pairs") else f"documents in {seqs['train']:,} train / {seqs['eval']:,} eval sequences of")
    lines = [f"inspect: {layout(r).data} (fingerprint {m['fingerprint']}): {m['counts']['docs_out']:,} {units} "
             f"<= {m['packing']['seq_len']:,} tokens; "
             f"{t['train_label']:,} of {t['train_total']:,} train tokens are labels ({share:.1%})"]
    for s in m["sources"]:
        lines.append(f"inspect: source {s['path']} (format {s['format']}, weight {s['weight']}): {s['rows']:,} rows, "
                     f"{s['taken']:,} read, {s['docs']:,} documents, {s['bad_skipped']:,} bad skipped")
    said = source_lines(m["sources"])
    lines += [x.replace("data: ", "inspect: ", 1) for x in said] or ["inspect: no ignored keys"]
    return lines


def _html(r: Recipe, m: dict, tok, shown: list[list[dict]], n_rows: int) -> str:
    e = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>zerotune inspect {e(r.name)}</title><style>"
             "body{font-family:sans-serif;max-width:72em;margin:1em auto} pre{white-space:pre-wrap;"
             "font-family:monospace;margin:0 0 .6em 0} .label{background:#c6efce} .doc{color:#0b5394;"
             "border-top:1px dashed #999;margin-top:.4em;font-size:90%} .pad{color:#999;font-size:90%}</style>",
             f"<h1>{e(r.name)}: what training sees</h1>",
             "<p>Label tokens (the loss is computed on them) are <span class='label'>highlighted</span>; a dashed "
             "line starts each document of a packed sequence (its position_ids restart at 0).</p><ul>"]
    parts += [f"<li>{e(x.removeprefix('inspect: '))}</li>" for x in summary_lines(r, m)]
    parts.append("</ul>")
    for k, docs in enumerate(shown):
        parts.append(f"<h2>{'pair' if docs and docs[0].get('name') else 'sequence'} {k + 1} of {n_rows:,}</h2>")
        for j, d in enumerate(docs):
            if d.get("name"):
                parts.append(f"<div class='doc'>{d['name']}: {d['end']:,} tokens, {d['labels']:,} label tokens "
                             "(the completion)</div><pre>")
                parts += [f"<span class='label'>{e(_decode(tok, ids))}</span>" if lab else e(_decode(tok, ids))
                          for lab, ids in d["runs"]]
                parts.append("</pre>")
                continue
            if d["padding"]:
                parts.append(f"<div class='pad'>padding: tokens {d['start']:,}-{d['end'] - 1:,}, no labels</div>")
                continue
            parts.append(f"<div class='doc'>document {j + 1}: tokens {d['start']:,}-{d['end'] - 1:,}, "
                         f"{d['labels']:,} label tokens</div><pre>")
            parts += [f"<span class='label'>{e(_decode(tok, ids))}</span>" if lab else e(_decode(tok, ids))
                      for lab, ids in d["runs"]]
            parts.append("</pre>")
    return "".join(parts) + "\n"


def inspect_data(r: Recipe, n: int = 2, out=None, color: bool | None = None) -> Path:
    """Print the first n prepared training sequences and the manifest's counts; write the HTML; return its path."""
    from datasets import load_from_disk

    out = out or sys.stdout
    color = out.isatty() if color is None else color
    m = require_prepared(r)  # missing or stale: one line naming `make data RECIPE=...`
    tok = load_tokenizer(r)
    ds = load_from_disk(str(layout(r).data_train))
    picked = ds.select(range(min(max(n, 0), len(ds))))
    if "rejected_input_ids" in ds.column_names:  # preference pairs
        shown = [pair_documents(row, m["pad_token_id"]) for row in picked]
    else:
        rows = picked[:]
        shown = [documents(i, lab, p, m["pad_token_id"])
                 for i, lab, p in zip(rows["input_ids"], rows["labels"], rows["position_ids"])]
    for line in summary_lines(r, m):
        print(line, file=out)
    print(f"inspect: label tokens {'in green' if color else f'between {OPEN} and {CLOSE}'}", file=out)
    for k, docs in enumerate(shown):
        print(render_text(tok, k, len(ds), docs, color), file=out)
    path = layout(r).inspect_html
    mf.write_atomic(path, _html(r, m, tok, shown, len(ds)))
    write_resolved_recipe(path.parent, r)
    print(f"inspect: wrote {path}", file=out)
    return path
