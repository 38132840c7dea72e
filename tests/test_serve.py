"""The OpenAI-compatible server over the tiny GGUF, driven by the official `openai` client on loopback."""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from zerotune.ports import free_port

pytestmark = pytest.mark.integration

KEY = "test-key-123"
N_CTX = 256


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    import uvicorn

    from zerotune.config import load_recipe
    from zerotune.serve import build_app

    port = free_port()
    r = load_recipe("tiny", [f"output_dir={tmp_path_factory.mktemp('serve')}", f"serve.port={port}",
                             f"serve.n_ctx={N_CTX}", f"serve.api_key={KEY}"])
    saved = os.environ.pop("ZEROTUNE_API_KEY", None)
    try:
        app, settings = build_app(r, tiny_gguf)
    finally:
        if saved is not None:
            os.environ["ZEROTUNE_API_KEY"] = saved
    assert settings.host == "127.0.0.1" and settings.api_key == KEY and settings.interrupt_requests is False
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            srv.should_exit = True
            pytest.fail("server did not become ready within 60 s")
        time.sleep(0.2)
    yield {"base": base, "name": r.name}
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "server did not shut down"
    from llama_cpp.server import app as server_app

    assert server_app._llama_proxy._current_model is None  # closed by the lifespan hook


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    c = OpenAI(base_url=server["base"] + "/v1", api_key=KEY, timeout=60, max_retries=0)
    yield c
    c.close()


def _chat(client, name, text, stream=False, max_tokens=8):
    msgs = [{"role": "user", "content": text}]
    if not stream:
        res = client.chat.completions.create(model=name, messages=msgs, max_tokens=max_tokens, temperature=0)
        return res.choices[0].message.content or "", res.choices[0].finish_reason
    content, reason = "", None
    with client.chat.completions.create(model=name, messages=msgs, max_tokens=max_tokens, temperature=0,
                                        stream=True) as s:
        for chunk in s:
            for ch in chunk.choices:
                content += ch.delta.content or ""
                reason = ch.finish_reason or reason
    return content, reason


def test_models_chat_completion_and_stream(server, client):
    name = server["name"]
    assert [m.id for m in client.models.list().data] == [name]
    res = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Repeat after me: red cat"}],
                                         max_tokens=8, temperature=0)
    assert res.choices[0].finish_reason in ("stop", "length") and res.usage.completion_tokens <= 8
    comp = client.completions.create(model=name, prompt="Hello, my name is", max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens <= 6
    full, reason = _chat(client, name, "Repeat after me: red cat")
    streamed, sreason = _chat(client, name, "Repeat after me: red cat", stream=True)
    assert streamed == full == (res.choices[0].message.content or "") and sreason == reason


def test_malformed_and_incomplete_requests_are_4xx_and_server_stays_up(server, client):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad = httpx.post(server["base"] + "/v1/chat/completions", content=b'{"messages": [', headers=h, timeout=30)
    assert 400 <= bad.status_code < 500
    missing = httpx.post(server["base"] + "/v1/chat/completions", json={"model": server["name"]}, headers=h, timeout=30)
    assert 400 <= missing.status_code < 500 and "messages" in missing.text
    assert client.models.list().data  # still up


def test_over_long_prompt_is_a_clear_400(server, client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server["name"], max_tokens=4,
                                       messages=[{"role": "user", "content": "red cat apple " * 200}])
    assert e.value.status_code == 400 and "context" in str(e.value).lower()
    assert client.models.list().data


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server["base"] + "/v1/chat/completions", headers=headers, timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 401


def test_twenty_concurrent_requests_complete_uncut(server, client):
    name = server["name"]
    prompts = [f"Repeat after me: word{i % 4}" for i in range(20)]
    reference = {p: _chat(client, name, p) for p in set(prompts)}
    with ThreadPoolExecutor(max_workers=20) as pool:
        futs = [pool.submit(_chat, client, name, p, i % 2 == 0) for i, p in enumerate(prompts)]
        results = [f.result(timeout=180) for f in futs]
    for p, (content, reason) in zip(prompts, results):
        assert reason in ("stop", "length")
        assert content == reference[p][0]  # streamed answers were not cut short by the other requests


def test_gguf_without_chat_template_is_refused(tiny_gguf, tmp_path):
    from zerotune.config import load_recipe
    from zerotune.serve import ServeError, build_app

    bad = tmp_path / "no-template.gguf"
    shutil.copyfile(tiny_gguf, bad)
    data = bytearray(bad.read_bytes()[: 10 * 2**20])
    key = b"tokenizer.chat_template"
    at = data.index(key)
    with open(bad, "r+b") as f:  # rename the key in place (same length): the template is gone
        f.seek(at)
        f.write(b"tokenizer.chat_templatX")
    r = load_recipe("tiny", [f"output_dir={tmp_path}"])
    with pytest.raises(ServeError, match="no embedded chat template"):
        build_app(r, bad)
