"""User errors end with one message on stderr (what, where, how to fix), exit code 2 and no traceback.

Most cases call `cli.main` in-process (what `python -m zerotune` runs, minus the interpreter start); the
subprocess cases check the real entry point, and the torchrun case that a worker's error is reported once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zerotune.cli import main

REPO = Path(__file__).resolve().parents[1]
MSG = [{"role": "user", "content": "Repeat after me: red cat"}, {"role": "assistant", "content": "You said: red cat"}]


def good(i: int) -> bytes:
    return (json.dumps({"messages": [{"role": "user", "content": f"Repeat {i}: red cat"},
                                     {"role": "assistant", "content": f"You said {i}: red cat"}]}) + "\n").encode()


def line(obj) -> bytes:
    return (json.dumps(obj) + "\n").encode()


# (file content, what the message must say) for the malformed files a newcomer brings; the bad row is line 2
BAD_FILES = {
    "empty": (b"", "no rows (the file is empty)"),
    "truncated_json": (good(0) + b'{"messages": [{"role": "user", "content": "a"}\n', "line 2: malformed JSON"),
    "not_utf8": (good(0) + '{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1"),
                 "line 2: not valid UTF-8"),
    "wrong_field": (good(0) + line({"conversations": MSG}), "line 2: missing field 'messages'"),
    "messages_not_list": (good(0) + line({"messages": {"role": "user", "content": "a"}}),
                          "line 2: 'messages' must be a non-empty list"),
    "unknown_role": (good(0) + line({"messages": [{"role": "human", "content": "a"}, MSG[1]]}),
                     "line 2: message 0 has unknown role 'human'"),
    "empty_content": (good(0) + line({"messages": [{"role": "user", "content": " "}, MSG[1]]}),
                      "line 2: message 0 (user) content is empty"),
    "no_assistant": (good(0) + line({"messages": MSG[:1]}), "line 2: conversation has no assistant turn"),
}


def write_recipe(tmp_path: Path, data: dict | None = None, **sections) -> Path:
    raw = {"name": "t", "output_dir": str(tmp_path / "run"),
           "model": {"init_config": "configs/models/tiny_llama31.json",
                     "tokenizer": str(REPO / "assets" / "tokenizer" / "llama3_1")},
           "data": {"seq_len": 64, **(data or {})}, **sections}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_main(capfd, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capfd.readouterr()
    return rc, out, err


def assert_one_message(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerotune: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_data_file_is_one_message(tmp_path, capfd, tokenizer_dir, case):
    content, needle = BAD_FILES[case]
    f = tmp_path / f"{case}.jsonl"
    f.write_bytes(content)
    rc, _, err = run_main(capfd, "data", str(write_recipe(tmp_path, {"sources": [{"path": str(f)}]})))
    msg = assert_one_message(rc, err, str(f), needle)
    if case != "empty":
        assert "Fix:" in msg and "on_bad_sample: skip" in msg


def test_overlong_sample_is_truncated_and_counted_or_named_when_nothing_is_left(tmp_path, capfd, tokenizer_dir):
    f = tmp_path / "long.jsonl"
    f.write_bytes(line({"messages": [MSG[0], {"role": "assistant", "content": "word " * 200}]}))
    recipe = str(write_recipe(tmp_path, {"sources": [{"path": str(f)}]}))
    rc, out, err = run_main(capfd, "data", recipe)
    assert rc == 0 and "1 truncated" in out, out + err
    rc, _, err = run_main(capfd, "data", recipe, "data.overlong=drop")
    assert_one_message(rc, err, str(f), "1 over-long documents dropped", "data.overlong")


def test_unknown_recipe_key_names_file_and_key(tmp_path, capfd):
    path = write_recipe(tmp_path, train={"lrr": 1e-4})
    rc, _, err = run_main(capfd, "plan", str(path))
    assert_one_message(rc, err, str(path), "train", "unknown key 'lrr'", "Did you mean 'lr'")


def test_old_force_flag_names_its_two_replacements(capfd):
    rc, _, err = run_main(capfd, "data", "tiny", "--force")
    assert_one_message(rc, err, "--rebuild", "--skip-preflight")


def test_quantize_without_a_trained_model(tmp_path, capfd):
    rc, _, err = run_main(capfd, "quantize", "tiny", f"output_dir={tmp_path}")
    assert_one_message(rc, err, str(tmp_path / "model"), "make finetune RECIPE=tiny")


def test_check_without_a_trained_model(tmp_path, capfd):
    rc, _, err = run_main(capfd, "check", "tiny", f"output_dir={tmp_path}")
    assert_one_message(rc, err, str(tmp_path / "model"), "make finetune RECIPE=tiny")


def test_check_of_a_corrupt_gguf_names_the_file(tmp_path, capfd):
    (tmp_path / "model").mkdir()
    gguf = tmp_path / "gguf" / "tiny-q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)  # a header cut short
    rc, _, err = run_main(capfd, "check", "tiny", f"output_dir={tmp_path}")
    assert_one_message(rc, err, str(gguf), "not a readable GGUF")


@pytest.mark.slow
def test_serve_without_a_gguf(tmp_path, capfd):
    rc, _, err = run_main(capfd, "serve", "tiny", f"output_dir={tmp_path}")
    assert_one_message(rc, err, str(tmp_path / "gguf"), "make quantize RECIPE=tiny")


def test_serve_limits_out_of_range(tmp_path, capfd):
    rc, _, err = run_main(capfd, "serve", "tiny", f"output_dir={tmp_path}", "serve.max_queue=-1")
    assert_one_message(rc, err, "serve.max_queue=-1: must be >= 0")


def test_unknown_plan_gpu_is_a_user_error(tmp_path, capfd):
    rc, _, err = run_main(capfd, "plan", "tiny", f"output_dir={tmp_path}", "plan.gpu=v101")
    assert_one_message(rc, err, "plan.gpu: 'v101' is not one of ['v100-32gb', 't4', 'a100-80gb', 'h100-80gb', 'h200', 'cpu']")


def test_hardware_that_cannot_do_the_precision_is_a_user_error(tmp_path, capfd):
    rc, _, err = run_main(capfd, "plan", "tiny", f"output_dir={tmp_path}", "train.precision=fp16")
    assert_one_message(rc, err, "precision fp16 requested on CPU")


def test_debug_shows_the_traceback(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("ZEROTUNE_DEBUG", "1")
    rc, _, err = run_main(capfd, "quantize", "tiny", f"output_dir={tmp_path}")
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("zerotune: ")


# ---- the real entry point -----------------------------------------------------------------------------

def zt(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotune", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_train_without_prepared_data_is_one_message(tmp_path):
    proc = zt("finetune", "tiny", f"output_dir={tmp_path}")
    assert_one_message(proc.returncode, proc.stderr, f"no prepared data in {tmp_path / 'data'}",
                       "make data RECIPE=tiny")
    assert "launching" not in proc.stdout  # refused before torchrun starts


def test_bad_override_from_the_command_line(tmp_path):
    proc = zt("data", "tiny", f"output_dir={tmp_path}", "data.seq_lenn=64")
    assert_one_message(proc.returncode, proc.stderr, "unknown key 'seq_lenn'", "Did you mean 'seq_len'")


@pytest.mark.slow
def test_plan_json_is_pure_json_on_stdout(tmp_path):
    proc = zt("plan", "tiny", f"output_dir={tmp_path}", "--json")
    assert proc.returncode == 0, proc.stderr
    from zerotune.planner.records import Plan

    plan = Plan.from_json(json.loads(proc.stdout))  # the whole plan, read back as the workers read plan.json
    assert plan.recipe == "tiny" and plan.recipe_batch.fits
    assert "Setting accelerator" not in proc.stdout + proc.stderr


@pytest.mark.integration
def test_worker_user_error_under_torchrun_is_reported_once(tmp_path):
    """What the launcher can check is refused before any worker starts; a user error only the workers meet is
    printed once (local rank 0), handed to the launcher in error.json, and torchrun's report stays off the log."""
    prep = zt("data", "tiny", f"output_dir={tmp_path}")
    assert prep.returncode == 0, prep.stderr[-2000:]
    # a held-out file that is not there is refused before any worker starts, not at the end of training, where
    # the last step's samples read it (and check after)
    proc = zt("finetune", "tiny", f"output_dir={tmp_path}", f"data.heldout={tmp_path / 'nope.jsonl'}")
    assert_one_message(proc.returncode, proc.stderr, f"eval set 'heldout': {tmp_path / 'nope.jsonl'} not found")
    assert "launching" not in proc.stdout and not (tmp_path / "train" / "recipe.resolved.yaml").exists()
    # the batch needs the world size, which the launcher knows: refused before launch too
    proc = zt("finetune", "tiny", f"output_dir={tmp_path}", "train.global_batch_tokens=1000")
    assert_one_message(proc.returncode, proc.stderr, "train.global_batch_tokens=1,000 is not a multiple",
                       "Nearest valid")
    assert "launching" not in proc.stdout
    # only the workers read the run folder's resolved recipe: broken there, every rank meets the error
    run_recipe = tmp_path / "train" / "recipe.resolved.yaml"
    run_recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    recipe["output_dir"], recipe["train"]["lr"] = str(tmp_path), -1.0
    run_recipe.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "zerotune.train", "torchrun", str(tmp_path), "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", "--master_port=0", "-m", "zerotune.train", "worker",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in log and "ChildFailedError" not in log, log[-3000:]
    from zerotune.layout import RunLayout
    from zerotune.train.handoff import Outcome

    handed = Outcome.read(RunLayout(tmp_path), proc.returncode).user_error
    assert handed["type"] == "RecipeError" and "train.lr" in handed["message"] and str(run_recipe) in handed["message"]
    # printed by local rank 0 at most once; if torchrun stopped rank 0 first (another rank exited before it), the
    # handoff says it was not printed and the launcher prints it (train/launch.py): the user always sees it
    said = [line for line in proc.stderr.splitlines() if line.startswith("zerotune: ")]
    assert len(said) <= 1 and (said or not handed["printed"]), proc.stderr[-2000:]


def test_an_output_dir_that_cannot_be_made_is_one_message(tmp_path, capfd):
    (tmp_path / "file").write_text("")
    rc, _, err = run_main(capfd, "data", "tiny", f"output_dir={tmp_path / 'file' / 'run'}")
    assert_one_message(rc, err, f"output_dir: cannot create or write in {tmp_path / 'file' / 'run'}", "set output_dir")


@pytest.mark.parametrize("content,says", [(None, "No such file"), ("# not json", "not a readable model config.json"),
                                          ("[1, 2]", "holds a JSON object, not list")])
def test_a_bad_init_config_is_one_message(tmp_path, capfd, content, says):
    cfg = tmp_path / "config.json"
    if content is not None:
        cfg.write_text(content)
    rc, _, err = run_main(capfd, "plan", "tiny", f"output_dir={tmp_path}", f"model.init_config={cfg}")
    assert_one_message(rc, err, f"{cfg}:", says, "model.init_config")


def test_a_tokenizer_folder_without_a_tokenizer_is_one_message(tmp_path, capfd):
    (tmp_path / "tok").mkdir()
    rc, _, err = run_main(capfd, "data", "tiny", f"output_dir={tmp_path / 'run'}", f"model.tokenizer={tmp_path / 'tok'}")
    assert_one_message(rc, err, f"model.tokenizer: no tokenizer loads from {tmp_path / 'tok'}", "tokenizer.json")


def test_a_folder_as_a_data_source_names_its_files(tmp_path, capfd):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part-0.jsonl").write_bytes(good(0))
    rc, _, err = run_main(capfd, "data", "tiny", f"output_dir={tmp_path / 'run'}", f"data.sources=[{tmp_path / 'shards'}]")
    assert_one_message(rc, err, "a folder; list its files as sources", f"{tmp_path / 'shards' / 'part-0.jsonl'}")


@pytest.mark.parametrize("override,says", [
    ("train.zero.offload_optimizer=cpu", "train.zero.offload_optimizer='cpu': a mapping, e.g."),  # AttributeError
    ("train.zero.stage=7", "train.zero.stage=7: must be 0, 1, 2 or 3"),  # planned as 'stage 0' before
    ("output_dir=", "output_dir: empty; give it a value"),  # wrote into a folder named 'None'
    ("eval.sets=[{name: a, path: x.jsonl, scorer: regex, pattern: '('}]", "eval.sets[0].pattern: '(' is not a "
                                                                          "regular expression"),  # after answering
])
def test_recipe_values_that_failed_later_are_refused_at_load(tmp_path, capfd, override, says):
    rc, _, err = run_main(capfd, "plan", "tiny", f"output_dir={tmp_path}", "data.heldout=null", override)
    assert_one_message(rc, err, says)


def test_a_recipe_file_that_is_not_a_mapping_or_not_readable(tmp_path, capfd):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    rc, _, err = run_main(capfd, "plan", str(tmp_path / "list.yaml"))
    assert_one_message(rc, err, "a recipe is a YAML mapping of sections", "not a list")
    (tmp_path / "bytes.yaml").write_bytes(b"\xff\xfe bad")
    rc, _, err = run_main(capfd, "plan", str(tmp_path / "bytes.yaml"))
    assert_one_message(rc, err, "cannot be read as a recipe")


@pytest.mark.parametrize("text,says", [
    ("model:\n  init_config: configs/models/tiny_llama31.json\nmodel:\n  tokenizer: x\n",
     "line 3: not valid YAML: key 'model' appears twice in this mapping; keep one"),  # the first was dropped
    ("name: t\ntrain:\n  lr: 1e-4\n  lr: 1e-3\n", "line 4: not valid YAML: key 'lr' appears twice"),
    ("model:\n\tinit_config: x\n", "line 2: not valid YAML: found character '\\t'"),  # was four lines
])
def test_a_recipe_yaml_error_is_one_line_with_its_line(tmp_path, capfd, text, says):
    (tmp_path / "r.yaml").write_text(text)
    rc, _, err = run_main(capfd, "plan", str(tmp_path / "r.yaml"))
    assert_one_message(rc, err, f"{tmp_path / 'r.yaml'} {says}")


def test_an_output_dir_that_exists_but_cannot_be_written(tmp_path, capfd):
    rc, _, err = run_main(capfd, "plan", "tiny", "output_dir=/proc")
    assert_one_message(rc, err, "output_dir: cannot create or write in /proc")


def test_a_missing_path_under_a_local_folder_is_not_sent_to_the_hub(tmp_path, capfd):
    """data/tiny/trainn (no suffix) went to datasets.load_dataset as a hub id: a FileNotFoundError traceback."""
    rc, _, err = run_main(capfd, "data", "tiny", f"output_dir={tmp_path}", "data.sources=[data/tiny/trainn]")
    assert_one_message(rc, err, "data source data/tiny/trainn: file not found")


@pytest.mark.parametrize("content,says", [("[1, 2]", "a DeepSpeed config is a JSON object"),
                                          ('{"zero_optimization": 3}', "whose zero_optimization is an object"),
                                          (None, "cannot be read (Is a directory)")])
def test_a_deepspeed_json_of_the_wrong_shape(tmp_path, capfd, content, says):
    ds = tmp_path / "ds.json"
    ds.mkdir() if content is None else ds.write_text(content)
    rc, _, err = run_main(capfd, "plan", "tiny", f"output_dir={tmp_path / 'run'}", f"train.deepspeed={ds}")
    assert_one_message(rc, err, f"train.deepspeed: {ds}", says)


def test_a_corrupt_parquet_source_and_an_unreadable_heldout_file(tmp_path, capfd):
    (tmp_path / "c.parquet").write_text("not parquet")
    rc, _, err = run_main(capfd, "data", "tiny", f"output_dir={tmp_path / 'run'}", f"data.sources=[{tmp_path / 'c.parquet'}]")
    assert_one_message(rc, err, "c.parquet: not a readable Parquet file")
    from zerotune.answering import load_rows
    from zerotune.config import load_recipe
    from zerotune.errors import UserError

    (tmp_path / "heldout.jsonl").write_bytes(b'\xff{"messages": [], "answer": "x"}\n')
    with pytest.raises(UserError, match="heldout.jsonl cannot be read"):  # finetune reads it before the launch
        load_rows(load_recipe("tiny", [f"data.heldout={tmp_path / 'heldout.jsonl'}"]).eval_sets()[0])


def test_a_source_whose_weight_takes_no_row_is_named(tmp_path, capfd):
    """weight 0.1 on a 1-row file rounded to 0 rows: the source was listed and silently left out."""
    (tmp_path / "one.jsonl").write_bytes(good(0))
    rc, _, err = run_main(capfd, "data", "tiny", f"output_dir={tmp_path / 'run'}",
                          f"data.sources=[data/tiny/train.jsonl, {{path: {tmp_path / 'one.jsonl'}, weight: 0.1}}]")
    assert_one_message(rc, err, "data.sources[1]", "weight 0.1 takes 0 of its 1 rows", "raise it above 0.5")


def test_overrides_may_follow_a_flag(tmp_path, capfd):
    """make inspect ARGS="--n 4 data.seq_len=512" puts an override after a flag; argparse's plain parse_args
    refused it ("unrecognized arguments")."""
    rc, out, _ = run_main(capfd, "plan", "tiny", "--json", f"output_dir={tmp_path}", "data.seq_len=128")
    from zerotune.planner.records import Plan

    assert rc == 0 and Plan.from_json(json.loads(out)).recipe_batch.seq_len == 128


def test_missing_deepspeed_config_names_the_key(tmp_path, capfd):
    rc, _, err = run_main(capfd, "plan", "tiny", f"output_dir={tmp_path}", "train.deepspeed=configs/deepspeed/nope.json")
    assert_one_message(rc, err, "train.deepspeed:", "nope.json not found", "configs/deepspeed/zero3.json")
