"""universal.convert's guards around DeepSpeed's converter, without a real conversion (tests/test_resume.py and
tests/test_slurm_cluster.py run real ones): a path DeepSpeed's globs and regexes would misread."""

from __future__ import annotations

import pytest

from zerotune import universal


@pytest.mark.parametrize("name", ["run (copy)+[1]", "run (copy)+"])
def test_deepspeeds_merge_reads_a_run_folder_with_regex_characters_through_the_alias(tmp_path, name):
    """ds_to_universal.merge_zero3_slices (the ZeRO-3 merge step) globs and regex-matches the unescaped path
    (ds_to_universal.py:251, 260): under `run (copy)+[1]` the glob reads [1] as a class and finds no fragment;
    under `run (copy)+` it finds them and the regex, reading (copy)+ as a group, cannot parse their names.
    Through universal's alias it merges the real fragments."""
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
    with universal._regex_safe_alias(src, out) as (src_alias, out_alias):
        assert universal._SAFE_PATH.fullmatch(str(out_alias)) and src_alias.resolve() == src.resolve()
        merge_zero3_slices(1, str(out_alias / "global_step8" / "zero"), str(out_alias / "global_step8" / "tmp"), param)
    for k, state in enumerate(states):
        merged = torch.load(out / "global_step8" / "zero" / param / f"{state}.pt", weights_only=False)
        assert torch.equal(merged, torch.arange(7.0) + k), state
    assert not src_alias.parent.exists(), "the alias folder goes, and only it"
    assert (out / "global_step8" / "tmp" / param / "0" / "fp32.00").is_file() and src.is_dir()
