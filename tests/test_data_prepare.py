"""`prepare` end to end on small local files: modes, over-long samples, cache, bad input, sources, mixtures, num_proc."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zerotune.config import from_dict
from zerotune.data import prepare as prep
from zerotune.data.cache import StaleDataError, require_prepared
from zerotune.data.prepare import prepare
from zerotune.data.sources import SourceError
from zerotune.data.tokenize import IGNORE, TemplateError, encode_chat
from zerotune.errors import BadSample
from zerotune.layout import layout

WORDS = "red blue green cat dog bird tree river stone cloud light sound".split()


def convo(i: int, turns: int = 1, system: bool = False) -> dict:
    msgs = [{"role": "system", "content": "You are terse."}] if system else []
    for t in range(turns):
        w = " ".join(WORDS[(i * 7 + t * 3 + k) % len(WORDS)] for k in range(1 + (i + t) % 5))
        msgs += [{"role": "user", "content": f"Repeat {i}.{t}: {w}"}, {"role": "assistant", "content": f"You said {w}"}]
    return {"messages": msgs}


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return path


def recipe(tmp_path: Path, tokenizer_dir, sources, out="run", **data):
    raw = {"name": "t", "output_dir": str(tmp_path / out),
           "model": {"init_config": "configs/models/tiny_llama31.json", "tokenizer": str(tokenizer_dir)},
           "data": {"sources": sources, "seq_len": 128, **data}}
    return from_dict(raw)


def run(r, **kw):
    return prepare(r, histogram=False, **kw)


def rows_of(r, split="train"):
    from datasets import load_from_disk

    return load_from_disk(str(layout(r).data / split))[:]


def split_docs(rows):
    """Packed rows back into (ids, labels) documents, padding pseudo-document left out."""
    docs = []
    for ids, labels, pos in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            if any(x != IGNORE for x in labels[a:b]):
                docs.append((ids[a:b], labels[a:b]))
    return docs


@pytest.fixture
def chat_file(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", [convo(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(24)])


# ---- modes ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_packed_rows_hold_exactly_the_documents(tmp_path, tokenizer_dir, tokenizer, chat_file):
    r = recipe(tmp_path, tokenizer_dir, [str(chat_file)], seq_len=128, packing=True)
    m = run(r)
    rows = rows_of(r)
    assert all(len(x) == 128 for x in rows["input_ids"])
    expected = [encode_chat(tokenizer, convo(i, 1 + i % 3, i % 2 == 0)["messages"], "all_assistant", "t")
                for i in range(24)]
    assert sorted(split_docs(rows)) == sorted(expected)
    assert all(lab[0] == IGNORE for _, lab in split_docs(rows))  # no label predicted across a document boundary
    assert m["counts"] == {"rows_in": 24, "bad_skipped": 0, "truncated": 0, "dropped_overlong": 0,
                           "dropped_no_labels": 0, "docs_out": 24}
    assert m["tokens"]["train_label"] == sum(sum(x != IGNORE for x in lab) for _, lab in expected)
    assert m["tokens"]["train_real"] == sum(len(i) for i, _ in expected)
    assert m["tokens"]["train_total"] == 128 * m["sequences"]["train"]
    assert m["pad_token_id"] == tokenizer.eos_token_id


@pytest.mark.slow
def test_unpacked_one_row_per_document_in_order(tmp_path, tokenizer_dir, tokenizer, chat_file):
    r = recipe(tmp_path, tokenizer_dir, [str(chat_file)], packing=False)
    m = run(r)
    rows = rows_of(r)
    assert m["sequences"]["train"] == 24 and m["packing"]["efficiency"] is None
    for i in range(24):
        ids, labels = encode_chat(tokenizer, convo(i, 1 + i % 3, i % 2 == 0)["messages"], "all_assistant", "t")
        assert rows["input_ids"][i] == ids and rows["labels"][i] == labels
        assert rows["position_ids"][i] == list(range(len(ids)))


def test_eval_split_partitions_documents(tmp_path, tokenizer_dir, chat_file):
    r = recipe(tmp_path, tokenizer_dir, [str(chat_file)], eval_fraction=0.25, packing=False)
    m = run(r)
    assert m["sequences"] == {"train": 18, "eval": 6}
    all_docs = sorted(rows_of(r)["input_ids"] + rows_of(r, "eval")["input_ids"])
    r2 = recipe(tmp_path, tokenizer_dir, [str(chat_file)], out="run2", packing=False)
    run(r2)
    assert all_docs == sorted(rows_of(r2)["input_ids"])


def test_overlong_truncate_drop_and_vanishing_labels(tmp_path, tokenizer_dir, tokenizer):
    long_user = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    long_reply = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]}
    f = write_jsonl(tmp_path / "long.jsonl", [convo(0), long_user, long_reply, convo(1)])

    r = recipe(tmp_path, tokenizer_dir, [str(f)], seq_len=64, overlong="truncate", packing=False)
    m = run(r)
    c = m["counts"]
    # long_user: truncation cuts away its whole (only) assistant turn -> dropped and counted, never a 0-label row
    assert (c["truncated"], c["dropped_no_labels"], c["dropped_overlong"], c["docs_out"]) == (2, 1, 0, 3)
    rows = rows_of(r)
    assert all(len(x) <= 64 for x in rows["input_ids"])
    assert all(any(x != IGNORE for x in lab) for lab in rows["labels"])
    full_ids, full_labels = encode_chat(tokenizer, long_reply["messages"], "all_assistant", "t")
    assert rows["input_ids"][1] == full_ids[:64] and rows["labels"][1] == full_labels[:64]

    r = recipe(tmp_path, tokenizer_dir, [str(f)], out="run_drop", seq_len=64, overlong="drop")
    c = run(r)["counts"]
    assert (c["truncated"], c["dropped_overlong"], c["dropped_no_labels"], c["docs_out"]) == (0, 2, 0, 2)


def test_loss_on_last_assistant(tmp_path, tokenizer_dir, tokenizer):
    f = write_jsonl(tmp_path / "c.jsonl", [convo(3, turns=3)])
    r = recipe(tmp_path, tokenizer_dir, [str(f)], packing=False, loss_on="last_assistant")
    run(r)
    assert rows_of(r)["labels"][0] == encode_chat(tokenizer, convo(3, 3)["messages"], "last_assistant", "t")[1]


# ---- cache ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cache_hit_and_invalidation(tmp_path, tokenizer_dir, chat_file, monkeypatch, capsys):
    r = recipe(tmp_path, tokenizer_dir, [str(chat_file)])
    m1 = run(r)
    assert require_prepared(r)["fingerprint"] == m1["fingerprint"]

    def boom(*a, **k):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(prep, "tokenize_to_disk", boom)
    assert run(r)["fingerprint"] == m1["fingerprint"]
    assert "cache hit" in capsys.readouterr().out
    monkeypatch.undo()

    # data section changed -> stale, and training-side check names what changed
    r_seq = recipe(tmp_path, tokenizer_dir, [str(chat_file)], seq_len=256)
    with pytest.raises(StaleDataError, match=r"stale.*data_section\.seq_len.*make data RECIPE=t"):
        require_prepared(r_seq)
    # num_proc does not change the output, so it does not invalidate
    require_prepared(recipe(tmp_path, tokenizer_dir, [str(chat_file)], num_proc=2))

    # source file changed
    with open(chat_file, "a") as f:
        f.write(json.dumps(convo(99)) + "\n")
    with pytest.raises(StaleDataError, match=r"sources\[0\]\.sha256"):
        require_prepared(r)
    m2 = run(r)
    assert m2["fingerprint"] != m1["fingerprint"] and m2["counts"]["rows_in"] == 25

    # tokenizer changed (a different chat template)
    tok2 = shutil.copytree(tokenizer_dir, tmp_path / "tok2")
    cfg = json.loads((tok2 / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("| trim", "")
    (tok2 / "tokenizer_config.json").write_text(json.dumps(cfg))
    r_tok = recipe(tmp_path, tok2, [str(chat_file)])
    with pytest.raises(StaleDataError, match="chat_template"):
        require_prepared(r_tok)


def test_require_prepared_missing(tmp_path, tokenizer_dir, chat_file):
    with pytest.raises(StaleDataError, match=r"no prepared data in .*Run `make data RECIPE=t`"):
        require_prepared(recipe(tmp_path, tokenizer_dir, [str(chat_file)]))


def test_failed_prepare_keeps_previous_cache(tmp_path, tokenizer_dir, chat_file):
    r = recipe(tmp_path, tokenizer_dir, [str(chat_file)])
    m1 = run(r)
    before = rows_of(r)
    with open(chat_file, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"\n')
    with pytest.raises(BadSample, match=r"chat\.jsonl line 25: malformed JSON.*on_bad_sample: skip"):
        run(r)
    assert (layout(r).data / "manifest.json").exists() and rows_of(r) == before
    assert json.loads((layout(r).data / "manifest.json").read_text())["fingerprint"] == m1["fingerprint"]
    assert not layout(r).data.with_name("data.tmp").exists()
    with pytest.raises(StaleDataError):  # the old cache is kept but training still refuses it: the source changed
        require_prepared(r)


# ---- bad input --------------------------------------------------------------------------------------

BAD_ROWS = [
    (b'{"messages": [{"role": "user", "content": "a"}\n', "malformed JSON", "one complete JSON object"),
    (json.dumps({"conversations": convo(0)["messages"]}) + "\n", "missing field 'messages'",
     "columns: {messages: conversations}"),
    (json.dumps({"messages": [{"role": "human", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n",
     "unknown role 'human'", "probably 'user'"),
    (json.dumps({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "b"}]}) + "\n",
     "content is empty", "fill in the content"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n", "no assistant turn", "add an assistant reply"),
    ('{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "b"}]}\n'.encode("latin-1"),
     "not valid UTF-8", "iconv"),
    (b"[1, 2]\n", "expected a JSON object", ""),
]


@pytest.mark.parametrize("bad, needle, fix", BAD_ROWS)
def test_bad_row_error_names_file_line_and_fix(tmp_path, tokenizer_dir, bad, needle, fix):
    f = write_jsonl(tmp_path / "d.jsonl", [convo(0), convo(1), bad if isinstance(bad, bytes) else bad.encode(), convo(2)])
    r = recipe(tmp_path, tokenizer_dir, [str(f)])
    with pytest.raises(BadSample) as e:
        run(r)
    msg = str(e.value)
    assert msg.startswith(f"{f} line 3: ") and needle in msg and fix in msg and "on_bad_sample: skip" in msg


def test_skip_counts_every_bad_row(tmp_path, tokenizer_dir):
    rows = [convo(0)] + [b if isinstance(b, bytes) else b.encode() for b, _, _ in BAD_ROWS] + [convo(1), b"\n"]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    m = run(recipe(tmp_path, tokenizer_dir, [str(f)], on_bad_sample="skip"))
    assert m["counts"]["rows_in"] == 2 + len(BAD_ROWS)  # blank lines are not rows
    assert m["counts"]["bad_skipped"] == len(BAD_ROWS) and m["counts"]["docs_out"] == 2
    assert [e.split(":")[0] for e in m["bad_examples"]] == [f"{f} line {i}" for i in range(2, 2 + len(BAD_ROWS))]


@pytest.mark.slow
def test_tokenizer_without_chat_template(tmp_path, tokenizer_dir, chat_file):
    tok = shutil.copytree(tokenizer_dir, tmp_path / "notemplate")
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TemplateError, match="no chat template"):
        run(recipe(tmp_path, tok, [str(chat_file)]))
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain text document"}])
    assert run(recipe(tmp_path, tok, [{"path": str(text), "format": "text"}]))["counts"]["docs_out"] == 1


def test_missing_and_unsupported_files(tmp_path, tokenizer_dir):
    with pytest.raises(SourceError, match="file not found"):
        run(recipe(tmp_path, tokenizer_dir, [str(tmp_path / "nope.jsonl")]))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(SourceError, match="unsupported file type '.txt'"):
        run(recipe(tmp_path, tokenizer_dir, [str(tmp_path / "x.txt")]))


# ---- local file types and mixtures ------------------------------------------------------------------

def test_json_parquet_csv_sources_match_jsonl(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = [convo(i, turns=1 + i % 2) for i in range(6)]
    jl = write_jsonl(tmp_path / "a.jsonl", convs)
    js = tmp_path / "a.json"
    js.write_text(json.dumps(convs, indent=1))
    pqf = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(convs), pqf)
    csvf = tmp_path / "a.csv"
    import csv
    with open(csvf, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "messages"])
        for i, c in enumerate(convs):
            w.writerow([i, json.dumps(c["messages"])])
    ref = None
    for p in (jl, js, pqf, csvf):
        r = recipe(tmp_path, tokenizer_dir, [str(p)], out=f"run_{p.suffix[1:]}", packing=False)
        run(r)
        got = rows_of(r)["input_ids"]
        ref = ref or got
        assert got == ref, p


def test_instruction_csv_and_prompt_completion_parquet(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csvf = tmp_path / "i.csv"
    csvf.write_text('question,input,response\n"Add, please",1 2,3\nSay hi,,hi\n')
    pqf = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "completion": "c"}, {"prompt": "p2", "completion": None}]), pqf)
    r = recipe(tmp_path, tokenizer_dir, [
        {"path": str(csvf), "format": "instruction", "columns": {"instruction": "question", "output": "response"}},
        {"path": str(pqf), "format": "prompt_completion"}], on_bad_sample="skip")
    m = run(r)
    assert m["counts"]["docs_out"] == 3 and m["counts"]["bad_skipped"] == 1
    assert m["bad_examples"][0].startswith(f"{pqf} row 1: missing field 'completion'")


def test_bad_json_and_csv_files_name_the_line(tmp_path, tokenizer_dir):
    js = tmp_path / "b.json"
    js.write_text('[\n {"messages": []},\n {"messages": \n]')
    with pytest.raises(SourceError, match=r"b\.json line 4 column 1: malformed JSON"):
        run(recipe(tmp_path, tokenizer_dir, [str(js)]))
    csvf = tmp_path / "b.csv"
    csvf.write_bytes(b'messages\n"[{""role"": ""user"", ""content"": ""caf\xe9""}]"\n')
    with pytest.raises(BadSample, match=r"b\.csv line 2: not valid UTF-8"):
        run(recipe(tmp_path, tokenizer_dir, [str(csvf)]))


def test_weighted_mixture(tmp_path, tokenizer_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [convo(i) for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [convo(100 + i) for i in range(4)])
    src = [{"path": str(a), "weight": 0.5}, {"path": str(b), "weight": 2.0}]
    r = recipe(tmp_path, tokenizer_dir, src, packing=False)
    m = run(r)
    assert m["counts"]["rows_in"] == 5 + 8
    assert [s["taken"] for s in m["sources"]] == [5, 8]
    ids = rows_of(r)["input_ids"]
    assert len(set(map(tuple, ids[:5]))) == 5  # a half of a, without repeats
    assert ids[5:9] == ids[9:13]  # b twice
    r2 = recipe(tmp_path, tokenizer_dir, src, out="again", packing=False)
    run(r2)
    assert rows_of(r2)["input_ids"] == ids  # seeded: the same half every time
    r3 = recipe(tmp_path, tokenizer_dir, [{"path": str(a), "weight": 2.5}], out="w25", packing=False, seed=1)
    assert run(r3)["counts"]["rows_in"] == 25


def test_num_proc_2_matches_num_proc_1(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_ROWS", 7)  # many chunks in flight, so ordering is really exercised
    pools = []
    real_ctx = prep.mp.get_context

    def spy(method=None):
        ctx = real_ctx(method)
        pools.append(method)
        return ctx

    monkeypatch.setattr(prep.mp, "get_context", spy)
    rows = [convo(i, turns=1 + i % 4, system=i % 3 == 0) for i in range(60)] + [b"not json\n"]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    out = {}
    for n in (1, 2):
        r = recipe(tmp_path, tokenizer_dir, [str(f)], out=f"np{n}", num_proc=n, on_bad_sample="skip", eval_fraction=0.1)
        m = run(r)
        out[n] = (m["fingerprint"], m["counts"], rows_of(r), rows_of(r, "eval"))
    assert out[1] == out[2]
    assert out[1][1]["bad_skipped"] == 1
    assert len(pools) == 1  # num_proc 2 really went through the process pool


@pytest.mark.slow
def test_cli_progress_and_histogram(tmp_path, tokenizer_dir, chat_file):
    r = recipe(tmp_path, tokenizer_dir, [str(chat_file)])
    prepare(r)  # default: histogram written
    assert (layout(r).data / "lengths.png").stat().st_size > 1000
    assert (layout(r).data / "recipe.resolved.yaml").exists()


# ---- every key accounted for, per source -----------------------------------------------------------

def test_ignored_keys_and_detected_sharegpt_in_manifest_and_log(tmp_path, tokenizer_dir, tokenizer, capsys):
    plain = [{**convo(i), "id": i} for i in range(3)]
    plain[0]["messages"][0]["name"] = "ann"
    plain[1]["messages"][1]["weight"] = 0
    plain[1]["messages"].append({"role": "user", "content": "again"})
    plain[1]["messages"].append({"role": "assistant", "content": "You said again", "weight": 1})
    share = [{"conversations": [{"from": "human", "value": m["messages"][0]["content"]},
                                {"from": "gpt", "value": m["messages"][1]["content"], "score": 5}],
              "source": "web"} for m in (convo(10), convo(11))]
    a, b = write_jsonl(tmp_path / "a.jsonl", plain), write_jsonl(tmp_path / "b.jsonl", share)
    r = recipe(tmp_path, tokenizer_dir, [str(a), str(b)], packing=False)
    m = run(r)
    log = capsys.readouterr().out
    sa, sb = m["sources"]
    assert sa["ignored_keys"] == {"rows": {"id": 3}, "messages": {"name": 1}} and sa["detected_sharegpt"] == 0
    assert sa["assistant_turns_weight_0"] == 1 and (sa["docs"], sa["bad_skipped"]) == (3, 0)
    assert sb["ignored_keys"] == {"rows": {"source": 2}, "messages": {"score": 2}} and sb["detected_sharegpt"] == 2
    assert f"data: {a}: ignored keys: id (3 rows), name (1 messages)" in log
    assert f"data: {b}: 2 rows are ShareGPT ({{from, value}} messages) under format messages: read as format " \
           "sharegpt" in log and f"data: {b}: ignored keys: source (2 rows), score (2 messages)" in log
    # the weight-0 turn is in the text, without labels; the detected rows train exactly as {role, content} rows
    rows = rows_of(r)
    labels = [x for x in rows["labels"][1] if x != IGNORE]
    assert tokenizer.decode(labels) == "You said again<|eot_id|>"
    assert plain[1]["messages"][1]["content"] + "<|eot_id|>" in tokenizer.decode(rows["input_ids"][1])
    assert rows["input_ids"][3:] == [encode_chat(tokenizer, convo(i)["messages"], "all_assistant", "t")[0]
                                     for i in (10, 11)]
