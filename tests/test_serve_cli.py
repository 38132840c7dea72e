"""`make serve` as a user runs it: the CLI starts the server on 127.0.0.1 and Ctrl-C stops it cleanly."""

import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO
from zerotune.ports import free_port

pytestmark = pytest.mark.integration


def test_cli_serves_and_stops_on_ctrl_c(tmp_path, tiny_gguf):
    (tmp_path / "gguf").mkdir()
    shutil.copy(tiny_gguf, tmp_path / "gguf" / "tiny-q8_0.gguf")
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zerotune", "serve", "tiny", f"output_dir={tmp_path}",
                             f"serve.port={port}", "serve.n_ctx=256"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, body = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert body and '"tiny"' in body, (tmp_path / "serve.log").read_text()[-2000:]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "serve.log").read_text()
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "Traceback" not in out, out[-2000:]
