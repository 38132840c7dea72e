"""sbatch scripts: valid bash, no site values, logs that a fresh clone can write, the same CLI the tests run;
and the deadline rule the workers apply at every step boundary (tests/test_slurm_cluster.py runs it all for real)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
SBATCH = sorted(SLURM.glob("*.sbatch"))
SCRIPTS = SBATCH + [SLURM / "env.sh", SLURM / "signal_workers.sh", REPO / "scripts" / "slurm_local_cluster.sh",
                    REPO / "scripts" / "llama_cpp.env", REPO / "scripts" / "setup.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
            pytest.fail("shellcheck missing in CI")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    subprocess.run(["shellcheck", "-x", "-s", "bash", str(script)], check=True, cwd=REPO)


def test_finetune_runs_the_zerotune_cli_and_never_parses_yaml():
    text = (SLURM / "finetune.sbatch").read_text()
    # srun starts the same processes `zerotune finetune` does, from the run folder the preflight resolved
    assert re.search(r"-m zerotune\.train torchrun \"\$RUN_DIR\" .*\n(.*\n)*\s+-m zerotune\.train worker \"\$RUN_DIR\"", text)
    assert "slurm/job.py preflight" in text and "slurm/job.py outcome" in text
    for banned in ("yq ", "grep ", "awk ", "sed ", ".yaml", "pkill", "killall"):
        assert banned not in text.replace("# ", ""), banned


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_no_site_values_and_logs_go_to_a_committed_folder(script):
    text = script.read_text()
    directives = re.findall(r"^#SBATCH\s+(\S+)", text, flags=re.M)
    site = [d for d in directives if re.match(r"--(account|partition|gres|gpus|cpus-per-task|qos|reservation|time)\b"
                                              r"|-[ApGct]\b", d)]
    assert not site, f"site values belong on the sbatch command line: {site}"
    assert "PLACEHOLDER" not in text
    assert "source slurm/env.sh" in text
    out = [d.split("=", 1)[1] for d in directives if d.startswith("--output=")]
    assert out, "a log path relative to the submit dir"
    folder = Path(out[0]).parent
    # SLURM opens --output before the script runs: a folder missing in a fresh clone fails the job with no log
    tracked = subprocess.run(["git", "ls-files", str(folder)], cwd=REPO, capture_output=True, text=True).stdout
    assert tracked.strip(), f"{folder} has no tracked file: a fresh clone would not have it"


def test_finetune_requeues_and_appends_to_its_log():
    directives = re.findall(r"^#SBATCH\s+(\S+)", (SLURM / "finetune.sbatch").read_text(), flags=re.M)
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert any(d.startswith("--signal=B:USR1@") for d in directives)


def test_the_preflight_knows_the_scripts_warning_lead():
    """slurm/job.py refuses a conversion that would not end before the time-limit warning; SLURM does not tell a job
    its --signal lead, so job.py states the script's: the two must agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slurm_job", SLURM / "job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    lead = re.search(r"^#SBATCH\s+--signal=B:USR1@(\d+)$", (SLURM / "finetune.sbatch").read_text(), flags=re.M)
    assert lead and int(lead.group(1)) == job.SIGNAL_LEAD_S


def test_deadline_rule():
    from zerotune.stopping import MARGIN_FRACTION, MARGIN_S, out_of_time, seconds_needed

    step, save = 3600.0, 120.0
    need = seconds_needed(step, save)
    assert need == pytest.approx((step + save) * (1 + MARGIN_FRACTION) + MARGIN_S)
    now = 1_000_000.0
    assert not out_of_time(now, now + need + 1, step, save), "one more step and its save fit"
    assert out_of_time(now, now + need - 1, step, save), "they don't: commit now"
    assert out_of_time(now, now - 10, step, save), "past the deadline: still commit (best left)"
    assert not out_of_time(now, None, step, save), "no time limit"
    assert not out_of_time(now, now + 1, None, save), "no step measured yet: nothing to predict from"
    # a save never measured counts as long as a step
    assert out_of_time(now, now + seconds_needed(step, step) - 1, step, None)
    assert not out_of_time(now, now + seconds_needed(step, step) + 1, step, None)


def test_plan_states_the_cost_of_preemption():
    from zerotune.stopping import seconds_needed
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan
    from zerotune.planner.report import format_plan
    from zerotune.planner.target import SAVE_BYTES_PER_S

    p = compute_plan(load_recipe("llama8b_zero3", ["train.save_steps=2"]))
    pe, step = p.preemption, p.time.seconds_per_step
    assert pe.save_bytes_per_s == SAVE_BYTES_PER_S and pe.save_steps == 2
    assert pe.save_s == pytest.approx(p.disk.checkpoint_bytes / SAVE_BYTES_PER_S)
    assert pe.idle_at_time_limit_s == pytest.approx(seconds_needed(step, pe.save_s))
    assert pe.lost_on_kill_s == pytest.approx(2 * step)
    assert pe.signal_lead_s >= seconds_needed(0, pe.save_s) and pe.signal_lead_s % 60 == 0
    text = format_plan(p)
    assert f"recommended --signal=B:USR1@{pe.signal_lead_s}" in text
    assert "no trained step lost" in text and "mid-step checkpoints are not implemented" in text


def _bash(script: str, env: dict | None = None) -> str:
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def test_check_t4_builds_with_setups_portable_flags_outside_the_shared_venv():
    flags = dict(line.split("=", 1) for line in _bash(
        "source scripts/llama_cpp.env; echo CPU=$LLAMA_CPU_CMAKE_ARGS; echo T4=$LLAMA_T4_CMAKE_ARGS").splitlines())
    assert "-DGGML_NATIVE=OFF" in flags["CPU"]  # the SIGILL fix (scripts/llama_cpp.env)
    assert flags["T4"].startswith(flags["CPU"]) and "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75" in flags["T4"]
    text = (SLURM / "check_t4.sbatch").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "source scripts/llama_cpp.env" in text and '"$LLAMA_T4_CMAKE_ARGS"' in code
    for banned in ("GGML_", "--force-reinstall", "LLAMA_CMAKE_ARGS="):  # one source of flags; .venv untouched
        assert banned not in code, banned
    assert not re.search(r"^\s*make ", code, flags=re.M), "check_t4 must not (re)build the shared .venv"
    assert re.search(r'pip install -q --no-deps --target "\$tmp"', code)
    assert 'PYTHONPATH="$site' in code
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "source scripts/llama_cpp.env" in setup and 'LLAMA_CMAKE_ARGS="${LLAMA_CMAKE_ARGS:-$LLAMA_CPU_CMAKE_ARGS}"' in setup
    assert re.findall(r"^#SBATCH\s+--mem=(\d+)G", text, flags=re.M) == ["110"]


def _setup_sdist() -> Path:
    """The llama-cpp-python sdist `make setup` downloaded and checked."""
    version = re.search(r"^LLAMA_CPP_VERSION=(\S+)$", (REPO / "scripts" / "llama_cpp.env").read_text(), re.M)[1]
    cache = Path(os.environ.get("ZEROTUNE_CACHE") or Path.home() / ".cache" / "zerotune")
    sdist = cache / "src" / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        if os.environ.get("CI"):  # .ci/run runs make setup, which downloads it: missing there is a failure
            pytest.fail(f"{sdist} missing after make setup")
        pytest.skip(f"{sdist} missing (make setup downloads it)")
    return sdist


@pytest.mark.slow
def test_llama_cpp_build_leaves_out_the_common_library_the_wheel_never_ships(tmp_path):
    """Half the compile a newcomer waits for is libllama-common, which llama-cpp-python forces on and never
    installs; the hook in setup's flags turns it off. Configured for real from setup's sdist (seconds, no compile)."""
    import tarfile

    with tarfile.open(_setup_sdist()) as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if "/vendor/llama.cpp/models/" not in m.name],
                       filter="data")
    src = next(tmp_path.glob("llama_cpp_python-*"))
    flags = _bash("source scripts/llama_cpp.env; echo $LLAMA_CPU_CMAKE_ARGS").split()
    assert any(f.startswith("-DCMAKE_PROJECT_INCLUDE=") for f in flags)
    targets = {}
    for name, args in (("setup", flags), ("without the hook", [f for f in flags if "PROJECT_INCLUDE" not in f])):
        build = tmp_path / name.replace(" ", "_")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-Wno-dev", *args], check=True,
                       capture_output=True)
        listing = subprocess.run(["cmake", "--build", str(build), "--target", "help"], check=True,
                                 capture_output=True, text=True).stdout
        targets[name] = set(re.findall(r"^\.\.\. (\S+)", listing, flags=re.M))
    assert "llama-common" in targets["without the hook"]  # llama-cpp-python forces it on: the hook is needed
    assert not {"llama-common", "cpp-httplib"} & targets["setup"]
    assert {"llama", "ggml", "ggml-base", "ggml-cpu"} <= targets["setup"]  # what the wheel ships and loads


@pytest.mark.slow
def test_check_t4_fails_early_with_one_line(tmp_path):
    env = {**os.environ, "ZEROTUNE_CACHE": str(tmp_path), "SLURM_SUBMIT_DIR": str(REPO)}
    r = subprocess.run(["bash", str(SLURM / "check_t4.sbatch"), "tiny"], cwd=REPO, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "run 'make setup' first" in r.stderr
    # with setup's sdist in place and no CUDA toolkit on PATH: the nvcc message, before any build
    sdist = _setup_sdist()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / sdist.name).symlink_to(sdist)
    path = ":".join(d for d in os.environ["PATH"].split(":") if not (Path(d) / "nvcc").exists())
    r = subprocess.run(["bash", str(SLURM / "check_t4.sbatch"), "tiny"], cwd=REPO, env={**env, "PATH": path},
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nvcc not on PATH" in r.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "wheels").exists()


def _stop_callback(monkeypatch, deadline: float, step_s: float, save_s: float):
    import signal

    from zerotune.train.callbacks import StopOnSignal

    monkeypatch.setenv("ZEROTUNE_DEADLINE", str(deadline))
    monkeypatch.delenv("ZEROTUNE_PID_DIR", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        stop = StopOnSignal()
    finally:  # pytest's own SIGTERM handling stays as it was
        for s, h in handlers.items():
            signal.signal(s, h)
    stop.step_times, stop.save_s = [step_s], save_s
    stop.end_estimate = lambda: (0.0, "measured")  # nothing after the last step unless a test says so
    return stop


def _step_end(stop, step: int, max_steps: int):
    from types import SimpleNamespace

    last = step >= max_steps  # what the Trainer's DefaultFlowCallback has set by now
    control = SimpleNamespace(should_save=last, should_training_stop=last)
    stop.on_step_end(SimpleNamespace(device="cpu"), SimpleNamespace(global_step=step, max_steps=max_steps,
                                                                    is_world_process_zero=True), control)
    return control


def test_deadline_at_the_last_step_finalizes_instead_of_requeueing(monkeypatch):
    """Issue 29 item 6: at the last step no further step has to fit, only the rest of the job. A 1-hour step with a
    2-minute save and 30 minutes left: the step before the last stops (exit 75, requeue); the last one finalizes."""
    import time

    from zerotune.stopping import finalize_fits, seconds_needed

    now, step_s, save_s = 1_000_000.0, 3600.0, 120.0
    monkeypatch.setattr(time, "time", lambda: now)
    assert finalize_fits(now, now + 1800, save_s) and not finalize_fits(now, now + 1800, 900.0)
    assert not finalize_fits(now, None, save_s), "no known deadline: no promise to finish"
    stop = _stop_callback(monkeypatch, now + 1800, step_s, save_s)
    control = _step_end(stop, 4, 5)
    assert stop.stopped_at == 4 and control.should_save and control.should_training_stop
    stop = _stop_callback(monkeypatch, now + 1800, step_s, save_s)
    control = _step_end(stop, 5, 5)
    assert stop.stopped_at is None, "the last step must finalize, not requeue"
    assert control.should_save and control.should_training_stop  # the Trainer's own final save and end
    # too little time even for finalize: stop with the commit, the requeued job only finalizes
    stop = _stop_callback(monkeypatch, now + seconds_needed(0, 2 * save_s) - 1, step_s, save_s)
    _step_end(stop, 5, 5)
    assert stop.stopped_at == 5 and stop.reason == "deadline"
    # a SIGTERM (preemption, scancel) at the last step still stops: the job may not come back to finalize
    stop = _stop_callback(monkeypatch, now + 1800, step_s, save_s)
    stop.requested = "SIGTERM"
    _step_end(stop, 5, 5)
    assert stop.stopped_at == 5 and stop.reason == "SIGTERM"


def test_the_last_step_reserves_the_end_of_trainings_validation_and_samples(monkeypatch, capsys):
    """Issue 41 item 1: after the last step the job still validates, samples, consolidates and finalizes; a job
    killed inside those is not requeued. The last step finishes only when all of that fits (the samples' time
    measured this attempt or planned, train/validation.py), else it commits and stops, and the requeued job does
    the rest. Two 2-minute saves and 30 minutes left: 20 minutes of samples fit, 30 do not; and with no
    estimate at all the end of training is assumed to take one step."""
    from zerotune.stopping import seconds_needed

    now, step_s, save_s = 1_000_000.0, 60.0, 120.0
    monkeypatch.setattr("time.time", lambda: now)
    for end_s, stops in ((1200.0, False), (1800.0, True)):
        stop = _stop_callback(monkeypatch, now + 1800, step_s, save_s)
        stop.end_estimate = lambda e=end_s: (e, "planned")
        assert (seconds_needed(0, 2 * save_s + end_s) > 1800) is stops
        _step_end(stop, 5, 5)
        assert (stop.stopped_at == 5) is stops and (stop.reason == "deadline" if stops else stop.reason is None)
    out = capsys.readouterr().out
    assert "the end of training needs ~2,304 s (validation and samples ~1,800 s planned" in out
    stop = _stop_callback(monkeypatch, now + 1800, 1700.0, save_s)
    stop.end_estimate = lambda: None
    _step_end(stop, 5, 5)
    assert stop.stopped_at == 5 and "~1,700 s assumed: one step" in capsys.readouterr().out


@pytest.mark.integration
def test_the_preflight_prints_only_its_line_on_stdout(tmp_path):
    """finetune.sbatch reads the preflight's stdout as `NPROC DEVICE RUN_DIR`: a library that prints while importing
    (transformers under WANDB_MODE=offline, which CI sets) must land in the job's log, not in that line (a CI run
    of 2026-11-27 read NPROC=[INFO] and the job died before training)."""
    import sys

    from conftest import _zt

    _zt("data", "tiny", f"output_dir={tmp_path}")
    env = {**os.environ, "WANDB_MODE": "offline", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}
    proc = subprocess.run([sys.executable, "slurm/job.py", "preflight", "tiny", f"output_dir={tmp_path}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"2 CPU {tmp_path}"], proc.stdout
    # since issue 51 the preflight no longer imports transformers' trainer integrations, whose import printed the
    # line; wherever a library prints, it is not on stdout
    assert "[INFO]" not in proc.stdout
