"""The output helpers every stage uses: the atomic file write, publish (stage beside, then swap), JSON Lines
read/append/rewind."""

from __future__ import annotations

import json

import pytest

from zerotune import manifest as mf


def test_write_atomic_replaces_a_file_whole_and_leaves_nothing_beside_it(tmp_path, monkeypatch):
    """Text (UTF-8) or bytes, fsynced or not, into a folder made for it; a write that fails leaves the old file and
    no temp file."""
    import os

    f = tmp_path / "sub" / "a.txt"
    mf.write_atomic(f, "caf\u00e9\n")
    assert f.read_bytes() == "caf\u00e9\n".encode("utf-8")
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    mf.write_atomic(f, b"\x00\x01", fsync=True)
    assert f.read_bytes() == b"\x00\x01" and len(synced) == 1
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        mf.write_atomic(f, "never seen")
    assert f.read_bytes() == b"\x00\x01" and [p.name for p in f.parent.iterdir()] == ["a.txt"]


def test_publish_replaces_a_folder_and_leaves_nothing_beside_it(tmp_path):
    final, staged = tmp_path / "model", tmp_path / "model.tmp"
    final.mkdir()
    (final / "old.bin").write_text("old")
    staged.mkdir()
    (staged / "new.bin").write_text("new")
    mf.publish(staged, final)
    assert [p.name for p in final.iterdir()] == ["new.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_publish_a_file_and_a_first_output(tmp_path):
    staged = tmp_path / "x.gguf.tmp"
    staged.write_bytes(b"v1")
    mf.publish(staged, tmp_path / "x.gguf")  # nothing published before
    staged.write_bytes(b"v2")
    mf.publish(staged, tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


def test_publish_of_a_missing_stage_keeps_the_old_output(tmp_path):
    final = tmp_path / "data"
    final.mkdir()
    (final / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        mf.publish(tmp_path / "data.tmp", final)
    assert (final / "manifest.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_jsonl_append_read_and_rewind_keep_each_step_once(tmp_path):
    path, discarded = tmp_path / "metrics.jsonl", tmp_path / "metrics.discarded.jsonl"
    assert mf.read_jsonl(path) == []
    mf.append_jsonl(path, [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)])
    mf.append_jsonl(path, {"step": 4, "loss": 0.25})
    assert [x["step"] for x in mf.read_jsonl(path)] == [1, 2, 3, 4]
    assert mf.rewind_jsonl(path, 2, discard_to=discarded) == 2
    assert [x["step"] for x in mf.read_jsonl(path)] == [1, 2]
    assert [json.loads(x)["step"] for x in discarded.read_text().splitlines()] == [3, 4]
    assert mf.rewind_jsonl(path, 0) == 0 and not path.exists()  # a fresh run starts the file anew
