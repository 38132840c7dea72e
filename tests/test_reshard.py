"""reshard.build_conversion's guards around DeepSpeed's converter, without a real conversion (tests/test_resume.py and
tests/test_slurm_cluster.py run real ones): a path DeepSpeed's globs and regexes would misread, a stop while
converting, and a job without the time to convert."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from zerotune import reshard, stopping
from zerotune.errors import UserError


@pytest.fixture(autouse=True)
def no_stop_asked():
    """A stop recorded by one test must not leak into the next (stopping keeps it per process)."""
    stopping._asked.clear()
    before = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    yield
    stopping._asked.clear()
    for s, h in before.items():
        signal.signal(s, h)


def _checkpoint(root: Path, ranks: int = 2, shard_bytes: int = 0) -> Path:
    """A committed-looking ZeRO-3 checkpoint's files as DeepSpeed names them; shards of `shard_bytes` (sparse)."""
    ckpt = root / "checkpoint-8"
    step = ckpt / "global_step8"
    step.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step8")
    for i in range(ranks):
        with open(step / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as f:
            f.truncate(shard_bytes)
        (step / f"zero_pp_rank_{i}_mp_rank_00_model_states.pt").write_bytes(b"model")
    return ckpt


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("name", ["run (copy)+[1]", "run (copy)+"])
def test_deepspeeds_merge_reads_a_run_folder_with_regex_characters_through_the_alias(tmp_path, name):
    """ds_to_universal.merge_zero3_slices (the ZeRO-3 merge step) globs and regex-matches the unescaped path
    (ds_to_universal.py:251, 260): under `run (copy)+[1]` the glob reads [1] as a class and finds no fragment;
    under `run (copy)+` it finds them and the regex, reading (copy)+ as a group, cannot parse their names.
    Through reshard's alias it merges the real fragments."""
    import torch
    from deepspeed.checkpoint.ds_to_universal import merge_zero3_slices

    ckpt = tmp_path / name / "checkpoints" / "checkpoint-8"
    out = ckpt / "universal.tmp"
    param = "model.embed_tokens.weight"
    states = ("fp32", "exp_avg", "exp_avg_sq")
    for k, state in enumerate(states):  # two ranks' fragments, named as DeepSpeed's extraction names them
        (out / "global_step8" / "tmp" / param / "0").mkdir(parents=True, exist_ok=True)
        for rank, t in enumerate((torch.arange(4.0) + k, torch.arange(4.0, 7.0) + k)):
            torch.save(t, out / "global_step8" / "tmp" / param / "0" / f"{state}.{rank:02d}")
    with pytest.raises((IndexError, ValueError)):  # why the alias exists: DeepSpeed 0.19.8 as pinned
        merge_zero3_slices(1, str(out / "global_step8" / "zero"), str(out / "global_step8" / "tmp"), param)

    src = ckpt / "global_step8"
    src.mkdir(parents=True)
    with reshard._regex_safe_alias(src, out) as (src_alias, out_alias):
        assert reshard._SAFE_PATH.fullmatch(str(out_alias)) and src_alias.resolve() == src.resolve()
        merge_zero3_slices(1, str(out_alias / "global_step8" / "zero"), str(out_alias / "global_step8" / "tmp"), param)
    for k, state in enumerate(states):
        merged = torch.load(out / "global_step8" / "zero" / param / f"{state}.pt", weights_only=False)
        assert torch.equal(merged, torch.arange(7.0) + k), state
    assert not src_alias.parent.exists(), "the alias folder goes, and only it"
    assert (out / "global_step8" / "tmp" / param / "0" / "fp32.00").is_file() and src.is_dir()


def test_a_stop_while_converting_removes_the_half_built_conversion(tmp_path, monkeypatch):
    """SIGUSR1 in the middle of DeepSpeed's conversion (as finetune.sbatch forwards its time-limit warning): Stopped
    at once, universal.tmp gone, the checkpoint as it was; the handlers before it are back."""
    from deepspeed.checkpoint import ds_to_universal

    ckpt = _checkpoint(tmp_path / "checkpoints")
    before = _files(ckpt)
    seen = {}

    def main(args):  # DeepSpeed's converter, half-way: fragments written, then the warning
        out = Path(args.output_folder)
        (out / "tmp" / "p" / "0").mkdir(parents=True)
        (out / "tmp" / "p" / "0" / "fp32.00").write_bytes(b"x" * 1000)
        seen["staging"] = (ckpt / "universal.tmp" / "global_step8" / "tmp" / "p" / "0" / "fp32.00").is_file()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(30)  # the handler raises inside the sleep
        seen["not stopped"] = True

    monkeypatch.setattr(ds_to_universal, "main", main)
    signal.signal(signal.SIGUSR1, stopping.record)  # as slurm/job.py preflight has it
    t0 = time.time()
    with pytest.raises(stopping.Stopped) as e:
        reshard.build_conversion(ckpt, 2)
    assert time.time() - t0 < 10 and seen == {"staging": True}
    assert e.value.signal == "SIGUSR1"
    assert "into converting checkpoint-8" in e.value.detail and "checkpoint-8 is intact" in e.value.detail
    assert not (ckpt / "universal.tmp").exists() and not (ckpt / "universal").exists()
    assert _files(ckpt) == before
    assert signal.getsignal(signal.SIGUSR1) is stopping.record

    # a stop already recorded in this process (the one above, or one during the rest of the preflight): no start
    def never(args):
        raise AssertionError("the conversion started after a stop")

    monkeypatch.setattr(ds_to_universal, "main", never)
    with pytest.raises(stopping.Stopped) as e:
        reshard.build_conversion(ckpt, 2)
    assert e.value.detail.startswith("before converting checkpoint-8") and _files(ckpt) == before


def test_a_conversion_that_cannot_end_before_the_warning_is_not_started(tmp_path):
    """60 GB of optimizer state (~17 min at CONVERT_BYTES_PER_S) and 10 minutes before the time-limit warning: one
    message naming the estimate, the time left and both fixes; nothing created."""
    from zerotune.planner.disk import CONVERT_BYTES_PER_S

    ckpt = _checkpoint(tmp_path / "checkpoints", shard_bytes=30 * 10**9)
    before = sorted(p.name for p in ckpt.rglob("*"))
    with pytest.raises(UserError) as e:
        reshard.build_conversion(ckpt, 2, convert_by=time.time() + 600)
    msg = str(e.value)
    assert CONVERT_BYTES_PER_S == 6e7, "the figures below assume it"
    assert "converting it for this job takes ~17 min (an estimate: 60.00 GB of optimizer state at 60 MB/s" in msg
    assert "this job has 10 min left before its time-limit warning" in msg and "not requeued" in msg
    assert "Resubmit with a --time at least" in msg and "or on 2 processes" in msg and "\n" not in msg
    assert sorted(p.name for p in ckpt.rglob("*")) == before

    # with the time: the rule lets it start (10% and a minute in hand, as for a training step)
    estimate = 60e9 / CONVERT_BYTES_PER_S
    reshard._refuse_without_time(ckpt, 2, time.time() + estimate * 1.1 + 61)
    with pytest.raises(UserError):
        reshard._refuse_without_time(ckpt, 2, time.time() + estimate * 1.1 + 59)
    reshard._refuse_without_time(ckpt, 2, None)  # no time limit


def test_a_run_folder_with_glob_characters_resumes_through_an_alias(tmp_path):
    """transformers finds the DeepSpeed checkpoint to resume with an unescaped glob of the checkpoint's path
    (integrations/deepspeed.py deepspeed_load_checkpoint): in `run [1]` it finds nothing and the run starts over.
    The worker resumes through reshard.glob_safe's alias, where the same glob finds it."""
    import glob

    ckpt = tmp_path / "run (copy)+[1]" / "checkpoints" / "checkpoint-8"
    (ckpt / "global_step8").mkdir(parents=True)
    assert glob.glob(f"{ckpt}/global_step*") == []  # what transformers would see without the alias
    with reshard.glob_safe(ckpt) as path:
        assert [Path(p).name for p in glob.glob(f"{path}/global_step*")] == ["global_step8"]
    assert not path.exists() and ckpt.exists()  # the alias is gone, the checkpoint untouched
    plain = tmp_path / "run" / "checkpoint-1"
    plain.mkdir(parents=True)
    with reshard.glob_safe(plain) as path:
        assert path == plain
