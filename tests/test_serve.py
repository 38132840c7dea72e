"""The OpenAI-compatible server over the tiny GGUF, driven by the official `openai` client and raw httpx on loopback.

The tiny GGUF embeds the tokenizer's plain Llama-3 template, which has no `tools` branch (the @lenml package ships
that one, not Llama-3.1's tool template). The server here serves the same GGUF with a template that also renders
`tools`, written over the old one in place (`tools_gguf`); without tools it renders what the old one did.
Fuzzing, load and the queue limit: tests/test_serve_stress.py.
"""

from __future__ import annotations

import json
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
CAP = 64  # serve.max_tokens here
MAX_KB = 64  # serve.max_request_kb here
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools: {{ tools | tojson }}<|eot_id|>"
    "{% endif %}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_gguf(tiny_gguf, tmp_path_factory):
    """tiny_gguf with TOOL_TEMPLATE embedded: (path, the template as embedded). It is padded with a Jinja comment
    to the old template's byte length and written over it, so nothing else in the file moves."""
    from zerotune.gguf_checks import chat_template_of

    old = chat_template_of(tiny_gguf).encode()
    pad = len(old) - len(TOOL_TEMPLATE.encode()) - len("{##}")
    assert pad >= 0, "TOOL_TEMPLATE must not be longer than the template it replaces"
    new = TOOL_TEMPLATE + "{#" + "-" * pad + "#}"
    out = tmp_path_factory.mktemp("tools_gguf") / "tiny-tools.gguf"
    shutil.copyfile(tiny_gguf, out)
    with open(out, "r+b") as f:
        data = f.read(10 * 2**20)
        assert data.count(old) == 1
        f.seek(data.index(old))
        f.write(new.encode())
    assert chat_template_of(out) == new
    return out, new


@pytest.fixture(scope="module")
def server(tools_gguf, tmp_path_factory):
    import uvicorn

    from zerotune.config import load_recipe
    from zerotune.serve import build_app

    port = free_port()
    r = load_recipe("tiny", [f"output_dir={tmp_path_factory.mktemp('serve')}", f"serve.port={port}",
                             f"serve.n_ctx={N_CTX}", f"serve.api_key={KEY}", f"serve.max_tokens={CAP}",
                             f"serve.max_request_kb={MAX_KB}",
                             "serve.max_queue=32"])  # 20 requests at once below, all admitted
    saved = os.environ.pop("ZEROTUNE_API_KEY", None)
    try:
        app, settings = build_app(r, tools_gguf[0])
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
    yield {"base": base, "name": r.name, "gguf": tools_gguf[0], "template": tools_gguf[1]}
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
    assert res.model == name  # not the GGUF's path on the server
    comp = client.completions.create(model=name, prompt="Hello, my name is", max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens <= 6
    full, reason = _chat(client, name, "Repeat after me: red cat")
    streamed, sreason = _chat(client, name, "Repeat after me: red cat", stream=True)
    assert streamed == full == (res.choices[0].message.content or "") and sreason == reason


H = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
# case: (path, body (sent as JSON, or as is when bytes), status, param, code). The comment is what llama-cpp-python
# 0.3.36 answered before serve_guard.py, measured with raw httpx ("500" = its validation dump with file paths).
MALFORMED = {
    "messages_a_string": (CHAT, {"messages": "hello"}, 400, "messages", None),  # 500
    "message_without_content": (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),  # 500
    "unknown_role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),  # 500
    "message_not_an_object": (CHAT, {"messages": [1]}, 400, "messages[0]", None),  # 500
    "null_user_content": (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content",
                          None),  # 200, the prompt said "None"
    "image_part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
                   400, "messages[0].content[0]", None),  # 200, the part rendered as a Python repr
    "temperature_hot": (CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature", None),  # 500
    "temperature_out_of_range": (CHAT, {"messages": USER, "temperature": 1e308}, 400, "temperature", None),  # 200
    "stream_yes": (CHAT, {"messages": USER, "stream": "yes"}, 400, "stream", None),  # 200 (coerced to true)
    "stop_a_number": (CHAT, {"messages": USER, "stop": 5}, 400, "stop", None),  # 500
    "prompt_token_ids": (COMP, {"prompt": [1, 2, 3]}, 400, "prompt", None),  # 500
    "prompt_two_strings": (COMP, {"prompt": ["a", "b"]}, 400, "prompt", None),  # 500 with an empty message
    "n_1000": (CHAT, {"messages": USER, "n": 1000, "max_tokens": 2}, 400, "n", None),  # 200 with one choice
    "best_of_3": (COMP, {"prompt": "x", "best_of": 3}, 400, "best_of", None),  # 200, ignored
    "suffix": (COMP, {"prompt": "x", "suffix": "y"}, 400, "suffix", None),  # 200, token 0 inserted
    "max_tokens_over_the_cap": (CHAT, {"messages": USER, "max_tokens": CAP + 1}, 400, "max_tokens", None),  # 200
    "max_tokens_negative": (CHAT, {"messages": USER, "max_tokens": -1}, 400, "max_tokens", None),  # 200, to n_ctx
    "logit_bias_not_a_token_id": (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, 400, "logit_bias", None),  # 500
    "logit_bias_outside_vocab": (CHAT, {"messages": USER, "logit_bias": {"999999999": 1}}, 400, "logit_bias",
                                 None),  # 200
    "seed_over_uint32": (CHAT, {"messages": USER, "seed": 2**40}, 400, "seed", None),  # 200, truncated
    "unknown_parameter": (CHAT, {"messages": USER, "foo": 1}, 400, "foo", None),  # 200, ignored
    "functions_deprecated": (CHAT, {"messages": USER, "functions": [{"name": "f", "parameters": {}}]}, 400,
                             "functions", None),  # 200, never rendered
    "stream_usage": (CHAT, {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}, 400,
                     "stream_options", None),  # 200 without a usage chunk
    "response_format_json_schema": (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
                                    "response_format.type", None),  # 500
    "tool_choice_unknown_tool": (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice.function.name", None),  # 500
    "tool_choice_required": (CHAT, {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}, 400,
                             "tool_choice", None),  # 200, not enforced
    "tool_choice_without_tools": (CHAT, {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice", None),  # 200
    "schema_count_over_the_limit": (CHAT, {"messages": USER, "response_format": {"type": "json_object", "schema": {
        "type": "string", "maxLength": 1001}}}, 400, "response_format.schema.maxLength", None),  # 200; 30000 crashed
    "grammar": (CHAT, {"messages": USER, "grammar": 'root ::= "a"'}, 400, "grammar", None),  # 200; no root crashed
    "nested_too_deeply": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + b"[" * 70 + b"]" * 70
                          + b"}", 400, None, None),  # 500
    "stream_over_long": (CHAT, {"messages": [{"role": "user", "content": "red cat " * 300}], "stream": True}, 400,
                         "messages", "context_length_exceeded"),  # 200 with an empty stream
    "unknown_model": (CHAT, {"messages": USER, "model": "gpt-4o"}, 404, "model", "model_not_found"),  # 200
    "body_not_an_object": (CHAT, [1, 2], 400, None, None),
    "truncated_json": (CHAT, b'{"messages": [', 400, None, None),
    "nan": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None, None),  # 200
    "not_utf8": (CHAT, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', 400, None, None),
    "lone_surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None, None),  # 500
    "embeddings": ("/v1/embeddings", {"input": "x"}, 404, None, None),  # 500
    "extras": ("/extras/tokenize", {"input": "x"}, 404, None, None),  # 200; /extras/detokenize could crash it
}


def assert_openai_error(r: httpx.Response, status: int, param=None, code=None, leaks=()) -> dict:
    """`status` with exactly OpenAI's error shape, and nothing of the server's insides in the body."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}, r.text
    assert err["message"] and err["param"] == param and err["code"] == code, r.text
    for leak in ("Traceback", 'File "', "site-packages", "llama_cpp", ".py", *leaks):
        assert leak not in r.text, (leak, r.text)
    return err


def test_served_greedy_answers_are_the_checked_ones(server, client):
    """What `make serve` answers at temperature 0 is what `zerotune check` scored: the GGUF through llama.cpp with
    no repetition penalty (llama-cpp-python's server would apply 1.1 unless asked otherwise)."""
    from zerotune.answering import gguf_answers, load_gguf

    rows = [{"messages": [{"role": "user", "content": t}]} for t in
            ("Repeat after me: red cat apple", "Repeat after me: blue dog tree tree tree", "Hello there")]
    llm = load_gguf(server["gguf"], n_ctx=N_CTX, logits_all=False)
    try:
        checked, _ = gguf_answers(llm, rows, 24)
    finally:
        llm.close()
    served = [_chat(client, server["name"], r["messages"][0]["content"], max_tokens=24)[0].strip() for r in rows]
    assert served == checked

@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_requests_get_an_openai_error_naming_the_field(server, case):
    path, body, status, param, code = MALFORMED[case]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server["base"] + path, headers=H, timeout=30, **kw)
    err = assert_openai_error(r, status, param, code, leaks=(str(server["gguf"].parent),))
    assert err["type"] == "invalid_request_error"
    assert param is None or param.split("[")[0].split(".")[0] in err["message"]  # the message names the field


def test_wrong_method_missing_fields_and_the_server_stays_up(server, client):
    assert_openai_error(httpx.get(server["base"] + CHAT, headers=H, timeout=30), 405)
    missing = httpx.post(server["base"] + CHAT, json={"model": server["name"]}, headers=H, timeout=30)
    assert_openai_error(missing, 400, "messages")
    assert client.models.list().data  # still up


def test_limits_body_size_and_max_tokens(server, client):
    big = {"messages": [{"role": "user", "content": "x" * (MAX_KB * 1024)}]}
    assert_openai_error(httpx.post(server["base"] + CHAT, json=big, headers=H, timeout=30), 413,
                        code="request_too_large")
    # without max_tokens a chat request gets the cap; llama-cpp-python alone would fill the context (245 here)
    res = client.chat.completions.create(model=server["name"], messages=USER, temperature=0)
    assert res.usage.completion_tokens == CAP and res.choices[0].finish_reason == "length"


def test_context_limit_is_exact_for_streamed_requests(server, client):
    """The guard counts the prompt as llama-cpp-python does: the longest it lets through is n_ctx - 1 tokens by
    the server's own count, and one more is a 400 before the stream starts (llama-cpp-python's own check runs only
    after it has answered 200)."""
    import openai

    def ask(n, stream):
        return client.chat.completions.create(model=server["name"], max_tokens=1, temperature=0, stream=stream,
                                              messages=[{"role": "user", "content": "red " * n}])

    n = N_CTX - ask(0, False).usage.prompt_tokens  # each "red " is one token
    assert ask(n - 1, False).usage.prompt_tokens == N_CTX - 1
    assert list(ask(n - 1, True))
    with pytest.raises(openai.BadRequestError) as e:
        ask(n, True)
    assert e.value.code == "context_length_exceeded" and f"is {N_CTX} tokens" in e.value.message


def test_tools_reach_the_embedded_chat_template(server, client, tokenizer):
    """`tools` go into the GGUF's own template: the server's prompt has exactly as many tokens as HF's rendering of
    the same template with the same tools (which shows the tool's JSON), and more than without them."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]

    def hf_tokens(tools):
        kw = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(msgs, chat_template=server["template"], add_generation_prompt=True,
                                             tokenize=True, return_dict=True, **kw)["input_ids"]

    hf_text = tokenizer.apply_chat_template(msgs, tools=[WEATHER], chat_template=server["template"],
                                            add_generation_prompt=True, tokenize=False)
    assert json.dumps([WEATHER], ensure_ascii=False) in hf_text
    with_tools = client.chat.completions.create(model=server["name"], messages=msgs, tools=[WEATHER], max_tokens=4,
                                                temperature=0)
    plain = client.chat.completions.create(model=server["name"], messages=msgs, max_tokens=4, temperature=0)
    assert with_tools.usage.prompt_tokens == len(hf_tokens([WEATHER]))
    assert plain.usage.prompt_tokens == len(hf_tokens(None)) < with_tools.usage.prompt_tokens
    for choice in ("auto", "none"):  # passed to the template; the answer comes back as content
        res = client.chat.completions.create(model=server["name"], messages=msgs, tools=[WEATHER], max_tokens=4,
                                             temperature=0, tool_choice=choice)
        assert res.usage.prompt_tokens == with_tools.usage.prompt_tokens


def test_named_tool_choice_returns_a_tool_call_matching_the_schema(server, client):
    """tool_choice naming a function: llama-cpp-python constrains the answer with a grammar built from the tool's
    JSON schema, so even the random tiny model returns a call whose arguments parse and fit the schema."""
    kw = dict(model=server["name"], messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=CAP, temperature=0)
    res = client.chat.completions.create(**kw)
    call = res.choices[0].message.tool_calls[0]
    assert res.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and set(args) <= {"city", "unit"}
    streamed = ""
    with client.chat.completions.create(stream=True, **kw) as s:
        for chunk in s:
            for ch in chunk.choices:
                streamed += "".join(tc.function.arguments or "" for tc in ch.delta.tool_calls or [])
    assert json.loads(streamed) == args


def test_a_tool_conversation_is_accepted(server, client):
    """The turns a client sends back after a tool call: the assistant's call with content null, the tool's reply."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    res = client.chat.completions.create(model=server["name"], messages=msgs, tools=[WEATHER], max_tokens=4,
                                         temperature=0)
    short = client.chat.completions.create(model=server["name"], messages=msgs[:1], tools=[WEATHER], max_tokens=4,
                                           temperature=0)
    assert res.choices[0].finish_reason in ("stop", "length")
    assert res.usage.prompt_tokens > short.usage.prompt_tokens  # the tool's reply is in the prompt


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
        assert_openai_error(r, 401, code="invalid_api_key")


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
