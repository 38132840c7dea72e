"""The log a person reads: known third-party noise dropped at its source (and nothing else), each logged
step printed once, a progress report that does not flood a log file, worker errors handed off once."""

from __future__ import annotations

import io
import json
import logging
import warnings

import pytest

from zerotune import errors, quiet
from zerotune.metrics import Progress, StepMetrics


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_file_is_ten_lines_with_time_left():
    out = io.StringIO()  # not a TTY, like `make demo > log`
    p = Progress(total=162, done=0, tokens_per_step=1024, stream=out)
    for step in range(1, 163):
        p.update(step)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10, lines
    assert lines[0].startswith("finetune:  10% (17/162 steps)") and "tok/s" in lines[0] and "left" in lines[0]
    assert lines[-1].startswith("finetune: 100% (162/162 steps)") and "0:00:00 left" in lines[-1]


def test_progress_after_resume_counts_from_the_checkpoint():
    out = io.StringIO()
    p = Progress(total=20, done=12, tokens_per_step=1024, stream=out)
    for step in range(13, 21):
        p.update(step)
    assert [x.split("(")[1].split(" ")[0] for x in out.getvalue().splitlines()] == ["14/20", "16/20", "18/20", "20/20"]


def test_progress_of_other_long_work_says_what_it_counts():
    """DPO's reference pass (preference/reference.py) reports through the same ten lines, counting forwards."""
    out = io.StringIO()
    p = Progress(total=100, done=0, tokens_per_step=None, stream=out, label="finetune: reference log-probs",
                 unit="forward")
    for k in range(1, 101):
        p.update(k)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[4].startswith("finetune: reference log-probs:  50% (50/100 forwards), ")
    assert "tok/s" not in out.getvalue() and "left" in lines[4]


def test_progress_on_a_terminal_is_one_live_bar():
    out = Tty()
    p = Progress(total=50, done=0, tokens_per_step=1024, stream=out)
    for step in range(1, 51):
        p.update(step)
    p.close()
    text = out.getvalue()
    assert "\n" not in text.rstrip("\n")  # redrawn in place with \r, never a line per step
    assert "50/50" in text and "tok/s" in text


@pytest.mark.slow
def test_each_logged_step_is_printed_once(tmp_path, capsys):
    """The Trainer adds PrinterCallback when disable_tqdm=True: it would print every logged step again as a dict."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    args = TrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, use_cpu=True, report_to=[], max_steps=2,
                             logging_steps=1, per_device_train_batch_size=1, save_strategy="no")
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 4
    metrics = StepMetrics(tmp_path / "metrics.jsonl", 8, 1.0, 1.0, None, 1)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[metrics])
    assert any(isinstance(c, PrinterCallback) for c in trainer.callback_handler.callbacks)
    metrics.attach(trainer)
    assert not any(isinstance(c, PrinterCallback) for c in trainer.callback_handler.callbacks)
    trainer.train()
    out = capsys.readouterr().out
    assert [x.split(",")[0] for x in out.splitlines() if x.startswith("finetune: step")] == ["finetune: step 1", "finetune: step 2"]
    assert "{'loss'" not in out and "'train_runtime'" not in out, out


def test_deepspeed_accelerator_line_is_dropped_and_its_other_lines_kept():
    quiet.silence_known_noise()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("DeepSpeed")
    h = Keep()
    log.addHandler(h)
    try:
        log.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        log.warning("zero.Init: something worth reading")
    finally:
        log.removeHandler(h)
    assert seen == ["zero.Init: something worth reading"]


def test_torch_deprecation_is_dropped_only_where_deepspeed_triggers_it():
    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.silence_known_noise()
        with pytest.raises(TypeError):  # no tensors: the deprecation warning is raised before the check
            dist.all_gather_into_tensor(None, None)
        warnings.warn_explicit("`torch.distributed.all_gather_into_tensor` is deprecated. Use all_gather_single.",
                               FutureWarning, "user.py", 1, module="user_code")
    msgs = [(str(w.message), w.category) for w in caught]
    assert len(msgs) == 1 and msgs[0][1] is FutureWarning and "deprecated" in msgs[0][0], msgs


def test_a_printed_line_is_dropped_and_the_rest_kept(capsys):
    with quiet.drop_stdout_lines("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("something else")
    assert capsys.readouterr().out == "something else\n"


def test_worker_error_handoff_is_written_by_every_rank_and_printed_by_local_rank_0(tmp_path, capsys, monkeypatch):
    from zerotune.train.handoff import hand_off

    e = errors.UserError("train.global_batch_tokens=1,000 is not a multiple of 512.")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    assert hand_off(tmp_path, e) == 2
    assert capsys.readouterr().err == ""
    assert errors.read_handoff(tmp_path)["printed"] is False  # only rank 1 failed: the launcher must print it
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    assert hand_off(tmp_path, e) == 2
    assert capsys.readouterr().err == f"zerotune: {e}\n"
    h = errors.read_handoff(tmp_path)
    assert h["printed"] is True and h["message"] == str(e) and h["type"] == "UserError"
    errors.clear_handoffs(tmp_path)
    assert errors.read_handoff(tmp_path) is None and not list(tmp_path.iterdir())
    assert json.dumps(h)  # plain JSON, readable by hand
