"""`zerotune data RECIPE`: data -> tokenized, labelled, packed Arrow + manifest.

Runs once, before any distributed launch (tokenizing under a NCCL barrier times
out on large data, LLaMA-Factory #2424). A fingerprint of sources, tokenizer,
chat template, the recipe's data section and library versions (data/cache.py)
decides whether the cache can be reused; training refuses a missing or stale cache.

Memory: nothing scales with the data set except a few arrays of per-document
integers (length, label count, bin assignment: roughly 50 bytes per document
with the Python bin lists). Rows are streamed from the sources, tokenized in
chunks (in a bounded number of in-flight chunks when num_proc > 1), and the
documents are appended to an on-disk Arrow file. Packing plans bins from the
lengths alone and copies documents out of that memory-mapped file into the
output in batches. Disk: about 8 bytes per document token for the intermediate
file plus 2 x 12 bytes per packed token while the output is written (the
intermediate copies are deleted before the new cache replaces the old one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from array import array
from collections import Counter, deque
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import manifest as mf
from ..config import Recipe
from ..errors import BadSample, UserError
from ..format_table import FORMATS
from ..layout import layout, write_resolved_recipe
from .cache import fingerprint, load_tokenizer
from .formats import read_row
from .packing import attention_pairs, best_fit_decreasing, iter_packed
from .replay import replay_key, replay_source
from .sources import SKIP_HINT, mixture, mixture_plan
from .tokenize import IGNORE, ChatRenderer, encode_batch, require_chat_template

CHUNK_ROWS = 256  # rows per tokenization task
# A preference pair's prepared row (preference.method): the chosen conversation in the SFT columns (input_ids, labels,
# position_ids: what check, inspect and the save's probe read as one document), the rejected one in these, and `pair`,
# its index in the split (where the reference log-probs of preference/reference.py are looked up)
PAIR_COLUMNS = ("rejected_input_ids", "rejected_labels")
WRITE_TOKENS = 1 << 22  # tokens buffered before an Arrow record batch is written


# ---- tokenization (in-process or in worker processes) -------------------------------------------

_ENC: dict = {}


def _init_worker(tok, name: str):
    _ENC["tok"] = tok
    _ENC["render"] = ChatRenderer(tok, name) if getattr(tok, "chat_template", None) else None


def _encode_chunk(chunk: list[tuple]) -> list[tuple]:
    """[(source, where, spec, data, error, loss_on)] -> [(source, where, (ids, labels) | BadSample, notes)];
    spec = (format, columns, roles, tools) of the source, notes = what formats.read_row says to count."""
    tok, render = _ENC["tok"], _ENC["render"]
    results: list = [None] * len(chunk)
    items, slots = [], []
    for k, (src, where, (fmt, columns, roles, tools), data, error, loss_on) in enumerate(chunk):
        if error is not None:
            results[k] = (src, where, error, None)
            continue
        try:
            doc = read_row(data, fmt, columns, where, roles, tools)
        except BadSample as e:
            results[k] = (src, where, e, None)
            continue
        items.append((where, doc.conv, loss_on, doc.tools))
        slots.append((k, doc.notes))
    for (k, notes), res in zip(slots, encode_batch(tok, render, items)):
        # a row refused while rendering counts as bad only: what it would have contributed is not counted
        results[k] = (chunk[k][0], chunk[k][1], res, None if isinstance(res, BadSample) else notes)
    return results


def _ordered_map(fn, chunks, num_proc: int, tok, name: str):
    """map(fn, chunks) in order; with num_proc > 1 in a process pool with a bounded number of chunks in flight
    (Pool.imap would read the whole input ahead into memory)."""
    if num_proc <= 1:
        _init_worker(tok, name)
        yield from map(fn, chunks)
        return
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a forked Rust thread pool can deadlock
    with ctx.Pool(num_proc, initializer=_init_worker, initargs=(tok, name)) as pool:
        pending: deque = deque()
        for c in chunks:
            pending.append(pool.apply_async(fn, (c,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class DocWriter:
    """Appends (ids, labels) documents to an Arrow IPC file in record batches."""

    def __init__(self, path: Path):
        import pyarrow as pa

        self.pa = pa
        self.schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
        self.writer = pa.ipc.new_file(str(path), self.schema)
        self.ids: list = []
        self.labels: list = []
        self.tokens = 0

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        self.ids.append(ids)
        self.labels.append(labels)
        self.tokens += len(ids)
        if self.tokens >= WRITE_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.ids:
            return
        pa = self.pa
        offsets = pa.array(np.concatenate([[0], np.cumsum([len(x) for x in self.ids])]).astype(np.int32))
        cols = [pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(x).astype(np.int32)))
                for x in (self.ids, self.labels)]
        self.writer.write_batch(pa.record_batch(cols, schema=self.schema))
        self.ids, self.labels, self.tokens = [], [], 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


class DocStore:
    """Random access to the documents of a DocWriter file, memory-mapped (no copy into RAM)."""

    def __init__(self, path: Path):
        import pyarrow as pa

        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        self.batches = []
        starts = [0]
        for b in range(reader.num_record_batches):
            rb = reader.get_batch(b)
            ids, labels = rb.column(0), rb.column(1)
            self.batches.append((ids.offsets.to_numpy(), ids.values.to_numpy(), labels.values.to_numpy()))
            starts.append(starts[-1] + rb.num_rows)
        self.starts = np.asarray(starts)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        b = int(np.searchsorted(self.starts, i, side="right")) - 1
        off, ids, labels = self.batches[b]
        j = i - int(self.starts[b])
        return ids[off[j]: off[j + 1]], labels[off[j]: off[j + 1]]


def _jobs(r: Recipe, sources: list, plan):
    chunk = []
    specs = [(s.format, s.columns, s.roles, s.tools) for s in sources]  # one object per source: pickled once a chunk
    for row in mixture(sources, r.data.seed, plan):
        chunk.append((row.source, row.where, specs[row.source], row.data, row.error, r.data.loss_on))
        if len(chunk) >= CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def tokenize_to_disk(r: Recipe, tok, path: Path, sources: list | None = None) -> dict:
    """Stream rows of `sources` (default the recipe's) -> documents in `path`; returns counts, per-document lengths
    and label counts."""
    sources = r.data.sources if sources is None else sources
    counts = {"rows_in": 0, "bad_skipped": 0, "truncated": 0, "dropped_overlong": 0, "dropped_no_labels": 0,
              "docs_out": 0}
    bad_examples: list[str] = []
    plan = mixture_plan(sources, r.data.seed)
    total = sum(p["taken"] for p in plan)
    # 4 bytes per document each (a Python list of ints would take ~36): what grows with the data set in this process
    lengths, n_labels = array("i"), array("i")
    per_source = [{"docs": 0, "bad_skipped": 0, "notes": Counter()} for _ in sources]
    writer = DocWriter(path)
    seq_len = r.data.seq_len
    try:
        with tqdm(total=total, desc="data: tokenize", unit="row", mininterval=2, disable=None) as bar:
            for results in _ordered_map(_encode_chunk, _jobs(r, sources, plan), r.data.num_proc, tok,
                                        r.model.tokenizer):
                bar.update(len(results))
                for src, where, res, notes in results:
                    counts["rows_in"] += 1
                    mine = per_source[src]
                    if isinstance(res, BadSample):
                        if r.data.on_bad_sample == "error":
                            raise BadSample(res.where, res.reason, (res.fix + " " if res.fix else "") + SKIP_HINT)
                        counts["bad_skipped"] += 1
                        mine["bad_skipped"] += 1
                        if len(bad_examples) < 20:
                            bad_examples.append(str(res))
                        continue
                    if notes:
                        mine["notes"].update(notes)
                    docs = _fit(res if r.pairs else (res,), seq_len, r.data.overlong, counts)
                    if docs is None:
                        continue
                    for ids, labels, n_lab in docs:  # a pair: chosen, then rejected, side by side in the file
                        writer.add(ids, labels)
                        lengths.append(len(ids))
                        n_labels.append(n_lab)
                    mine["docs"] += 1
    finally:
        writer.close()
    counts["docs_out"] = len(lengths) // (2 if r.pairs else 1)  # a pair's two conversations are one row
    return {"counts": counts, "bad_examples": bad_examples,
            "sources": [_source_entry(s, p, mine) for s, p, mine in zip(sources, plan, per_source)],
            "lengths": np.asarray(lengths, dtype=np.int64), "n_labels": np.asarray(n_labels, dtype=np.int64)}


def _fit(docs: tuple, seq_len: int, overlong: str, counts: dict) -> list | None:
    """A row's documents (one, or a pair's two) cut to seq_len as data.overlong says, with their label counts; None
    when the row is dropped (over-long under `drop`, or truncation removed every label of one of them: a 0/0 loss).
    Counted per row, never kept silently."""
    if any(len(ids) > seq_len for ids, _ in docs):
        if overlong == "drop":
            counts["dropped_overlong"] += 1
            return None
        counts["truncated"] += 1
    out = [(ids[:seq_len], labels[:seq_len], int(np.count_nonzero(labels[:seq_len] != IGNORE))) for ids, labels in docs]
    if any(n == 0 for _, _, n in out):
        counts["dropped_no_labels"] += 1
        return None
    return out


def _source_entry(src, plan: dict, mine: dict) -> dict:
    """A source in the manifest: its rows, what became of them, and what formats.read_row counted (over the rows
    read and not refused; a source with weight 2 is read twice)."""
    notes = mine["notes"]
    keys = {kind: {k.split(":", 1)[1]: n for k, n in sorted(notes.items(), key=lambda kv: (-kv[1], kv[0]))
                   if k.startswith(kind[:-1] + ":")} for kind in ("rows", "messages")}
    return {"path": src.path, "format": src.format, "weight": src.weight, "rows": plan["rows"],
            "taken": plan["taken"], "bad_skipped": mine["bad_skipped"], "docs": mine["docs"],
            "detected_sharegpt": notes["detected_sharegpt"], "rows_with_tools": notes["rows_with_tools"],
            "tool_call_turns": notes["tool_call_turns"],
            "assistant_turns_weight_0": notes["assistant_turns_weight_0"],
            **({k: notes[k] for k in PAIR_NOTES} if FORMATS[src.format].pair else {}), "ignored_keys": keys}


# What the pair formats detect (formats.py _read_preference), as prepare says it per source
PAIR_NOTES = {"implicit_prompt": "rows have no separate prompt: the prompt is the chosen and rejected conversations' "
                                 "shared prefix (full conversations, as UltraFeedback and HH-RLHF ship them)",
              "prompt_repeated": "rows repeat their prompt at the start of chosen and rejected (UltraFeedback's shape): "
                                 "read once, as the prompt",
              "hh_text": "rows are HH-RLHF text ('\\n\\nHuman: ... \\n\\nAssistant: ...'): split into user and "
                         "assistant turns"}


def source_lines(sources: list[dict]) -> list[str]:
    """What the log says about each source beyond the totals: a format detected, keys ignored, tools, weights."""
    lines = []
    for s in sources:
        said = []
        said += [f"{s[k]:,} {what}" for k, what in PAIR_NOTES.items() if s.get(k)]
        if s.get("detected_sharegpt"):
            said.append(f"{s['detected_sharegpt']:,} rows are ShareGPT ({{from, value}} messages) under format "
                        f"{s['format']}: read as format sharegpt (set it in the recipe to say so)")
        ignored = [f"{k} ({n:,} {kind})" for kind in ("rows", "messages") for k, n in s["ignored_keys"][kind].items()]
        if ignored:
            said.append("ignored keys: " + ", ".join(ignored))
        tools = [f"{s[k]:,} {what}" for k, what in (("rows_with_tools", "rows with tools"),
                                                     ("tool_call_turns", "tool-call turns"),
                                                     ("assistant_turns_weight_0", "assistant turns with weight 0 "
                                                                                  "(no loss)")) if s.get(k)]
        if tools:
            said.append(", ".join(tools))
        lines += [f"data: {s['path']}: {x}" for x in said]
    return lines


def _split_eval(n: int, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices, both in document order."""
    if frac <= 0 or n < 2:
        return np.arange(n), np.arange(0)
    idx = np.random.default_rng(seed).permutation(n)
    n_eval = min(n - 1, max(1, int(round(frac * n))))
    is_eval = np.zeros(n, dtype=bool)
    is_eval[idx[:n_eval]] = True
    return np.flatnonzero(~is_eval), np.flatnonzero(is_eval)


def _write_rows(store: DocStore, doc_idx: np.ndarray, lengths: np.ndarray, r: Recipe, pad_id: int,
                work: Path, dest: Path, desc: str) -> dict:
    """Packed (or one-per-document) rows of the documents `doc_idx` -> a `datasets` folder at dest."""
    import pyarrow as pa
    from datasets import Dataset

    schema = pa.schema([(k, pa.list_(pa.int32())) for k in ("input_ids", "labels", "position_ids")
                        + (PAIR_COLUMNS if r.pairs else ())] + ([("pair", pa.int32())] if r.pairs else []))
    arrow = work / f"{desc}.arrow"
    n_rows, padding, total, pairs = 0, 0, 0, 0
    if r.pairs:  # one row per pair: the chosen conversation in the SFT columns, the rejected one beside it
        def rows_of_pairs():
            for k, i in enumerate(doc_idx.tolist()):
                (ids, labels), (rej, rej_labels) = store[2 * i], store[2 * i + 1]
                yield {"input_ids": ids, "labels": labels, "position_ids": np.arange(len(ids), dtype=np.int32),
                       "rejected_input_ids": rej, "rejected_labels": rej_labels, "pair": k}, 0
        rows, n_total = rows_of_pairs(), len(doc_idx)
    elif r.data.packing:
        bins = best_fit_decreasing(lengths[doc_idx], r.data.seq_len)
        rows = iter_packed(bins, lambda k: store[int(doc_idx[k])], r.data.seq_len, pad_id)
        n_total = len(bins)
    else:
        def rows_unpacked():
            for i in doc_idx.tolist():
                ids, labels = store[i]
                yield {"input_ids": ids, "labels": labels, "position_ids": np.arange(len(ids), dtype=np.int32)}, 0
        rows, n_total = rows_unpacked(), len(doc_idx)

    buf: dict[str, list] = {k: [] for k in schema.names}
    buf_tokens = 0

    def flush(w):
        nonlocal buf, buf_tokens
        if buf["input_ids"]:
            cols = []
            for k in schema.names:
                if k == "pair":  # the pair's index in its split: the key of its reference log-probs (preference/)
                    cols.append(pa.array(buf[k], type=pa.int32()))
                    continue
                offsets = np.concatenate([[0], np.cumsum([len(x) for x in buf[k]])]).astype(np.int32)
                cols.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(buf[k]).astype(np.int32))))
            w.write_batch(pa.record_batch(cols, schema=schema))
        buf = {k: [] for k in schema.names}
        buf_tokens = 0

    with pa.ipc.new_stream(str(arrow), schema) as w, \
            tqdm(total=n_total, desc=f"data: write {desc}", unit="seq", mininterval=2, disable=None) as bar:
        for row, pad in rows:
            for k in schema.names:
                buf[k].append(row[k])
            n_rows += 1
            padding += pad
            n = len(row["input_ids"]) + len(row.get("rejected_input_ids", ()))
            total += n
            pairs += attention_pairs(row["position_ids"]) + len(row.get("rejected_input_ids", ())) ** 2
            buf_tokens += n
            bar.update(1)
            if buf_tokens >= WRITE_TOKENS:
                flush(w)
        flush(w)
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # our own bar above already covered this
    try:
        ds = Dataset.from_file(str(arrow))
        ds.save_to_disk(str(dest))
        del ds
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    arrow.unlink()
    return {"rows": n_rows, "padding": padding, "total_tokens": total, "attention_pairs": pairs}


def _percentiles(lengths) -> dict:
    if len(lengths) == 0:
        return {}
    q = np.percentile(lengths, [0, 50, 90, 99, 100])
    return {k: int(v) for k, v in zip(["min", "p50", "p90", "p99", "max"], q)}


def _histogram(lengths, seq_len: int, path: Path) -> None:
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


def prepare(r: Recipe, rebuild: bool = False, histogram: bool = True) -> dict:
    if not r.data.sources:
        raise UserError(f"recipe {r.name}: data.sources is empty; list at least one file or hub data set.")
    tok = load_tokenizer(r)
    if any(FORMATS[s.format].chat for s in r.data.sources):
        require_chat_template(tok, r.model.tokenizer)
    fp = fingerprint(r, tok)
    paths = layout(r)
    out = paths.data
    old = mf.read(paths.data_manifest)
    if not rebuild and old and old.get("fingerprint") == fp["fingerprint"] and paths.data_train.exists():
        print(f"data: cache hit ({out}, fingerprint {fp['fingerprint']}); nothing to do")
        return old

    # Build next to the old cache and swap at the end: a failure leaves the old cache intact.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    work = tmp / "_build"
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        sources, replay = list(r.data.sources), None
        if r.data.replay:  # the base model's answers join as one more source (data/replay.py)
            task_rows = sum(p["taken"] for p in mixture_plan(sources, r.data.seed))
            src, replay = replay_source(r, tok, task_rows, replay_key(r, tok))
            sources.append(src)
            t0 = time.perf_counter()  # answering has its own time (replay.seconds)
        info = tokenize_to_disk(r, tok, work / "docs.arrow", sources)
        t1 = time.perf_counter()
        lengths, n_labels = info.pop("lengths"), info.pop("n_labels")
        if len(lengths) == 0:
            raise UserError(_nothing_usable(r, info))
        store = DocStore(work / "docs.arrow")
        per = 2 if r.pairs else 1  # documents per row: a pair's chosen and rejected lie side by side
        train_idx, eval_idx = _split_eval(len(lengths) // per, r.data.eval_fraction, r.data.seed)
        tr = _write_rows(store, train_idx, lengths, r, tok.pad_token_id, work, tmp / paths.data_train.name, "train")
        ev = (_write_rows(store, eval_idx, lengths, r, tok.pad_token_id, work, tmp / paths.data_eval.name, "eval")
              if len(eval_idx) else {"rows": 0})
        del store
        shutil.rmtree(work)
        t2 = time.perf_counter()
        docs_of = (lambda idx: np.concatenate([2 * idx, 2 * idx + 1])) if r.pairs else (lambda idx: idx)
        real = int(lengths[docs_of(train_idx)].sum())
        label_tokens = int(n_labels[docs_of(train_idx)].sum())
        manifest = {
            "stage": "data",
            "recipe": r.name,
            **fp,
            **info,
            "sequences": {"train": tr["rows"], "eval": ev["rows"]},
            "tokens": {"train_real": real, "train_total": tr["total_tokens"], "train_label": label_tokens,
                       "padding": tr["padding"] if r.data.packing else None},
            "packing": {"enabled": r.data.packing, "seq_len": r.data.seq_len,
                        "efficiency": round(real / tr["total_tokens"], 4) if r.data.packing else None},
            "doc_length": _percentiles(lengths),
            # sum of d^2 / sum of d over the training rows' documents (padding tails included): the mean span a token
            # attends over with per-document attention; the planner times attention with it (planner/compute.py _flops)
            "attention_span": round(tr["attention_pairs"] / max(1, tr["total_tokens"]), 1),
            "pad_token_id": tok.pad_token_id,
            "replay": replay,
            "pairs": _pair_counts(lengths, n_labels, train_idx, eval_idx) if r.pairs else None,
            "timing_s": {"tokenize": round(t1 - t0, 2), "pack_and_write": round(t2 - t1, 2)},
        }
        if histogram:
            _histogram(lengths, r.data.seq_len, tmp / "lengths.png")
        mf.write(tmp / paths.data_manifest.name, manifest)
        write_resolved_recipe(tmp, r)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    mf.publish(tmp, out)
    for line in source_lines(info["sources"]):
        print(line)
    c = info["counts"]
    docs, rows = ("pairs", "pairs (chosen + rejected rows)") if r.pairs else ("documents", "sequences")
    print(f"data: {c['rows_in']} rows -> {c['docs_out']} {docs} ({c['bad_skipped']} bad skipped, "
          f"{c['truncated']} truncated, {c['dropped_overlong']} dropped as over-long, {c['dropped_no_labels']} dropped "
          f"with no label tokens left) -> {tr['rows']} train / {ev['rows']} eval {rows} of <= {r.data.seq_len} "
          f"tokens; {label_tokens:,} label tokens; " + (f"packing efficiency {manifest['packing']['efficiency']}; "
          if r.data.packing else "not packed; ") + f"wrote {out}")
    return manifest


def _pair_counts(lengths, n_labels, train_idx, eval_idx) -> dict:
    """Preference pairs in the manifest: how many per split, the completions' label tokens (chosen, rejected), and
    the mean padded row: a pair's chosen and rejected rows are padded to the longer of the two (a micro-batch of one
    pair: preference/objective.py collate), what the planner times a step and the reference pass with."""
    padded = np.maximum(lengths[2 * train_idx], lengths[2 * train_idx + 1]) if len(train_idx) else np.zeros(1)
    return {"train": len(train_idx), "eval": len(eval_idx),
            "chosen_label_tokens": int(n_labels[2 * train_idx].sum()),
            "rejected_label_tokens": int(n_labels[2 * train_idx + 1].sum()),
            "longest_row": int(lengths.max()) if len(lengths) else 0,
            "padded_row_tokens_mean": round(float(padded.mean()), 1)}


def _nothing_usable(r: Recipe, info: dict) -> str:
    """Why no document survived, naming the sources, for the one-line error."""
    empty = [s["path"] for s in info["sources"] if s["rows"] == 0]
    if empty and len(empty) == len(info["sources"]):
        return (f"data source {', '.join(empty)}: no rows (the file is empty). Fix: point data.sources at the "
                f"file that holds the data, or fill it (recipe {r.name}).")
    c = info["counts"]
    why = [f"{c['bad_skipped']} bad rows skipped (on_bad_sample: skip; first: {info['bad_examples'][0]})"
           if c["bad_skipped"] else "",
           f"{c['dropped_overlong']} over-long documents dropped (data.overlong: drop, data.seq_len {r.data.seq_len})"
           if c["dropped_overlong"] else "",
           f"{c['dropped_no_labels']} documents lost every label token to truncation at data.seq_len {r.data.seq_len}"
           if c["dropped_no_labels"] else ""]
    srcs = ", ".join(s["path"] for s in info["sources"])
    return (f"data source {srcs}: no usable samples after preparation ({c['rows_in']} rows read; "
            f"{'; '.join(w for w in why if w) or 'nothing kept'}). Fix: repair the rows, raise data.seq_len or set "
            "data.overlong: truncate.")
