"""The typed handoff between a run's processes (train/handoff.py): what one writes, the next reads back as the
same type; a missing file reads as None (a run that did not stop early has no stopped.json)."""

from __future__ import annotations

import torch

from zerotune.train.handoff import PROBE_FILE, Probe, RunRecord, Stopped


def test_stopped_and_run_record_round_trip(tmp_path):
    assert Stopped.read(tmp_path / "stopped.json") is None
    s = Stopped(step=4, signal="SIGUSR1", checkpoint="runs/x/checkpoints/checkpoint-4", committed=True)
    s.write(tmp_path / "stopped.json")
    assert Stopped.read(tmp_path / "stopped.json") == s
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
