"""The typed handoff between a run's processes (train/handoff.py): what one writes, the next reads back as the
same type; a missing file reads as None (a run that did not stop early has no stopped.json)."""

from __future__ import annotations

import torch

from zerotune.train.handoff import PROBE_FILE, Probe, RunRecord, StopRecord


def test_stop_record_and_run_record_round_trip(tmp_path):
    assert StopRecord.read(tmp_path / "stopped.json") is None
    s = StopRecord(step=4, signal="SIGUSR1", checkpoint="runs/x/checkpoints/checkpoint-4", committed=True)
    s.write(tmp_path / "stopped.json")
    assert StopRecord.read(tmp_path / "stopped.json") == s
    rec = RunRecord(world_size=2, device="cpu", data_fingerprint="abc", choice={"precision": "fp32"},
                    batch={"grad_accum": 2}, steps=16, elapsed_s=12.5, base="runs/x/base")
    rec.write(tmp_path / "run.json")
    assert RunRecord.read(tmp_path / "run.json") == rec


def test_probe_round_trip_keeps_dtype_and_values(tmp_path):
    p = Probe({"input_ids": torch.arange(8).unsqueeze(0)}, torch.randn(1, 8, 32).half(), n_params=123,
              precision="fp16", trainable_params=None)
    p.save(tmp_path)
    q = Probe.load(tmp_path)
    assert q.logits.dtype == torch.float16 and torch.equal(q.logits, p.logits)
    assert torch.equal(q.probe["input_ids"], p.probe["input_ids"]) and (q.n_params, q.precision) == (123, "fp16")
    Probe.discard(tmp_path)
    assert not (tmp_path / PROBE_FILE).exists()


def test_commit_marker_round_trips_and_reads_every_older_format(tmp_path):
    """checkpoint.CommitMarker: what CommitCheckpoints writes reads back as the same record; markers committed by
    older zerotunes (no batch, no save_s, no world size; test_resume.py writes {step, files}) still read, with
    None for what they lack; a checkpoint never committed reads as None."""
    import json

    from zerotune.checkpoint import MARKER, CommitMarker, problem

    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    assert CommitMarker.read(ckpt) is None and problem(ckpt) == "never committed (interrupted while saving)"
    (ckpt / "weights.bin").write_bytes(b"x" * 10)
    m = CommitMarker(4, 2, global_batch_tokens=1024, seq_len=256, micro_batch_size=1, grad_accum=2, save_s=1.5,
                     files={"weights.bin": 10})
    m.write(ckpt)
    assert CommitMarker.read(ckpt) == m and problem(ckpt) is None
    on_disk = json.loads((ckpt / MARKER).read_text())  # the file's keys are the format older readers know
    assert on_disk["step"] == 4 and on_disk["grad_accum"] == 2 and on_disk["files"] == {"weights.bin": 10}
    for old in ({"step": 4, "files": {"weights.bin": 10}},
                {"step": 4, "world_size": 4, "global_batch_tokens": 2048},
                {"step": 4, "world_size": 2, "global_batch_tokens": 1024, "seq_len": 256, "micro_batch_size": 1,
                 "grad_accum": 2, "files": {"weights.bin": 10}, "from_a_newer_zerotune": True}):
        (ckpt / MARKER).write_text(json.dumps(old))
        read = CommitMarker.read(ckpt)
        assert read.step == 4 and read.files == old.get("files", {}) and read.save_s is None
        assert (read.grad_accum, read.global_batch_tokens) == (old.get("grad_accum"), old.get("global_batch_tokens"))
