"""`zerotune inspect`: prepared sequences as training sees them, read back from the packed Arrow rows."""

from __future__ import annotations

import io
import json
import re

import yaml

from zerotune.cli import main
from zerotune.data.prepare import prepare
from zerotune.data.tokenize import IGNORE, encode_chat
from zerotune.layout import layout


def _recipe_file(tmp_path, tokenizer_dir, rows) -> str:
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "insp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "insp", "output_dir": str(tmp_path / "run"),
        "model": {"init_config": "configs/models/tiny_llama31.json", "tokenizer": str(tokenizer_dir)},
        "data": {"sources": [str(src)], "seq_len": 128, "packing": True}}))
    return str(path)


def test_inspect_shows_documents_labels_and_padding_of_a_packed_row(tmp_path, tokenizer_dir, tokenizer, capsys):
    from zerotune.config import load_recipe

    rows = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w}!"},
                          {"role": "user", "content": "Again."},
                          {"role": "assistant", "content": f"{w} again.", "weight": 0 if w == "red" else 1}],
             "id": k} for k, w in enumerate(["red", "green", "blue"])]
    recipe = _recipe_file(tmp_path, tokenizer_dir, rows)
    assert main(["inspect", recipe]) == 2  # not prepared yet: one line naming the command
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no prepared data" in err and "make data RECIPE=insp" in err

    r = load_recipe(recipe)
    prepare(r, histogram=False)
    capsys.readouterr()
    assert main(["inspect", recipe, "--n", "1"]) == 0
    out = capsys.readouterr().out  # not a terminal: plain markers, no colour
    assert "\033[" not in out
    assert "inspect: source " in out and "3 rows, 3 read, 3 documents, 0 bad skipped" in out
    assert "ignored keys: id (3 rows)" in out and "1 assistant turns with weight 0 (no loss)" in out

    from datasets import load_from_disk

    row = load_from_disk(str(layout(r).data_train))[0]
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    pad = 128 - sum(len(encode_chat(tokenizer, d["messages"], "all_assistant", "t")[0]) for d in rows)
    assert len(starts) == 4 and pad > 0  # all three conversations packed into one row, then the padding
    assert [int(x) for x in re.findall(r"-- document \d+: tokens (\d+)-", out)] == starts[:3]
    assert f"-- padding: tokens {starts[3]}-127, {pad} x" in out
    # each document's marked text is exactly its label tokens, decoded: the weight-0 reply is not marked
    marked = re.findall(r"⟦(.*?)⟧", out.split("== sequence 1")[1], re.S)
    want = []
    for a, b in zip(starts, starts[1:]):
        lab = row["labels"][a:b]
        run = []
        for x in lab + [IGNORE]:
            if x != IGNORE:
                run.append(x)
            elif run:
                want.append(tokenizer.decode(run))
                run = []
    assert marked == want and "red again.<|eot_id|>" not in marked and "green again.<|eot_id|>" in marked

    html = layout(r).inspect_html.read_text()
    assert html.split("<h2>sequence 1")[1].count("<span class='label'>") == len(want) and "document 3" in html and "padding" in html
    buf = io.StringIO()
    from zerotune.data.view import inspect_data

    inspect_data(r, n=1, out=buf, color=True)  # a terminal: colour instead of markers
    assert "\033[32m" in buf.getvalue() and "⟦" not in buf.getvalue()
