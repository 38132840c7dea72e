"""`zerotune serve` under hostile and heavy traffic, as a user starts it (the CLI, in its own process) on loopback.

- a property-based fuzz test of request bodies (hypothesis): no 5xx, an OpenAI-shaped error for every refusal,
  nothing of the server's insides in any body, the process alive after every request;
- 100 concurrent mixed requests: every answer that completes equals the sequential one, the server's peak RSS
  stays within RSS_BOUND of its warmed-up RSS;
- the queue limit: over serve.max_queue, 429 with Retry-After, and the `openai` client's retries get through.

The server runs in a subprocess so that a request that crashes it (two did, before serve_guard.py) fails the test
with its log instead of taking pytest down, and so that its RSS is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from conftest import REPO
from zerotune.ports import free_port

pytestmark = pytest.mark.integration

N_CTX = 256
CAP = 64
RSS_BOUND = 256 * 2**20  # the load test's first round: peak RSS over the warmed-up server's (docs/evaluation.md)
RSS_GROWTH = 32 * 2**20  # its second, identical round: peak RSS over the first round's
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def _rss(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


@contextlib.contextmanager
def _serve(tmp_path, gguf, *overrides):
    """`python -m zerotune serve tiny` over `gguf` until the block ends; yields (base URL, process, log path)."""
    (tmp_path / "gguf").mkdir()
    shutil.copy(gguf, tmp_path / "gguf" / "tiny-q8_0.gguf")  # where `make quantize` puts it
    port, log_path = free_port(), tmp_path / "serve.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zerotune", "serve", "tiny", f"output_dir={tmp_path}",
                             f"serve.port={port}", f"serve.n_ctx={N_CTX}", f"serve.max_tokens={CAP}", *overrides],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        yield base, proc, log_path
        assert proc.poll() is None, "the server died: " + log_path.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    if "Traceback" in out:  # no request reached an unexpected error, logged or not; show it, not the access log
        lines = [x for x in out[max(0, out.index("Traceback") - 2000):].splitlines() if not x.startswith("INFO:")]
        raise AssertionError("a traceback in the server's log:\n" + "\n".join(lines)[:6000])


@pytest.fixture(scope="module")
def stress_server(tiny_gguf, tmp_path_factory):
    with _serve(tmp_path_factory.mktemp("stress"), tiny_gguf, "serve.max_queue=128") as s:  # the 100 at once fit
        yield s


# --- the fuzz test --------------------------------------------------------------------------------------------

ODD = st.sampled_from([None, True, False, 0, -1, 1, 2**31, 2**64, -(2**63), 0.5, -1e-300, 1e300, "", "x" * 300,
                       "\x00", "\ud800", [], {}, [1, "a"], {"a": None}])
JSONV = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=12),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)
ANY = ODD | JSONV
TEXT = st.text(max_size=40)


def field(good):
    """A field's value: a good one or anything at all."""
    return good | ANY


SCHEMA = st.sampled_from([
    {}, {"type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"]},
    {"type": "string", "minLength": 100000}, {"type": "array", "items": {"$ref": "#/nope"}},
    {"type": "integer", "minimum": 5, "maximum": 1}, {"$ref": "#"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a|b)*$"}}}]) | JSONV
GRAMMAR = st.sampled_from(['root ::= "a"', "garbage ::=", "root ::= foo", "", 'root ::= root "a"', "root ::= [",
                           'root ::= ("a"{0,1000}){0,1000}', 'root ::= "a"{0,100000}'])
TOOL = st.fixed_dictionaries({"type": field(st.just("function")), "function": field(st.fixed_dictionaries(
    {"name": field(st.sampled_from(["f", "g"])), "parameters": SCHEMA}, optional={"description": TEXT}))})
TOOL_CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT, "arguments": TEXT})})
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2)
MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "function", "developer", "wizard"]))},
    optional={"content": field(TEXT | PARTS), "tool_calls": field(st.lists(TOOL_CALL, max_size=2)),
              "tool_call_id": field(TEXT), "name": field(TEXT)})
GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": TEXT}),
                         min_size=1, max_size=2)
SAMPLING = {  # both endpoints
    "model": field(st.sampled_from(["tiny", "gpt-4o"])), "max_tokens": field(st.integers(-2, 80)),
    "temperature": field(st.floats(-1, 3)), "top_p": field(st.floats(-1, 2)), "top_k": field(st.integers(-1, 2**40)),
    "min_p": field(st.floats(-1, 2)), "repeat_penalty": field(st.floats(-1, 3)),
    "presence_penalty": field(st.floats(-3, 3)), "stream": field(st.booleans()),
    "stop": field(st.lists(TEXT, max_size=3) | TEXT), "n": field(st.integers(0, 3)),
    "seed": field(st.integers(-2, 2**40)), "min_tokens": field(st.integers(-1, 100)),
    "logit_bias": field(st.dictionaries(st.sampled_from(["0", "1", "128255", "128256", "-1", "abc", "01"]),
                                        st.floats(-200, 200), max_size=3)),
    "logit_bias_type": field(st.sampled_from(["input_ids", "tokens"])), "grammar": field(GRAMMAR),
    "mirostat_mode": field(st.integers(-1, 3)), "user": field(TEXT), "bogus": ANY}
CHAT_ONLY = {
    "messages": field(st.lists(MESSAGE, min_size=1, max_size=3)), "max_completion_tokens": field(st.integers(-2, 80)),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 30)),
    "tools": field(st.lists(TOOL, max_size=2)), "parallel_tool_calls": field(st.booleans()),
    "tool_choice": field(st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})})),
    "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                                   optional={"schema": SCHEMA})),
    "functions": field(st.lists(st.fixed_dictionaries({"name": TEXT, "parameters": SCHEMA}), max_size=1))}
COMP_ONLY = {
    "prompt": field(TEXT | st.lists(TEXT, max_size=2) | st.lists(st.integers(-1, 130000), max_size=4)),
    "suffix": field(TEXT), "echo": field(st.booleans()), "logprobs": field(st.integers(-1, 30)),
    "best_of": field(st.integers(0, 3))}
GOOD_SAMPLING = {"temperature": st.floats(0, 2), "stream": st.booleans(), "stop": st.lists(TEXT, max_size=2),
                 "seed": st.integers(0, 2**32 - 1), "top_k": st.integers(0, 100), "grammar": GRAMMAR}


def _request(path, body):
    return st.tuples(st.just("POST"), st.just(path), body.map(lambda b: json.dumps(b).encode()))


REQUESTS = st.one_of(
    _request(CHAT, st.fixed_dictionaries({}, optional={**SAMPLING, **CHAT_ONLY})),  # anything in every field
    _request(COMP, st.fixed_dictionaries({}, optional={**SAMPLING, **COMP_ONLY})),
    _request(CHAT, st.fixed_dictionaries(  # well-formed, so generation, streaming, tools and grammars run too
        {"messages": GOOD_MESSAGES, "max_tokens": st.integers(1, 16)},
        optional={**GOOD_SAMPLING, "tools": st.lists(TOOL, max_size=1), "response_format": CHAT_ONLY[
            "response_format"], "tool_choice": CHAT_ONLY["tool_choice"], "logprobs": st.booleans()})),
    _request(COMP, st.fixed_dictionaries({"prompt": TEXT, "max_tokens": st.integers(1, 16)},
                                         optional={**GOOD_SAMPLING, "echo": st.booleans()})),
    st.tuples(st.sampled_from(["POST", "GET", "PUT"]),
              st.sampled_from([CHAT, COMP, "/v1/models", "/v1/embeddings", "/extras/detokenize", "/docs", "/"]),
              ANY.map(lambda b: json.dumps(b).encode()) | st.binary(max_size=60)),
)


def _check_response(r: httpx.Response, method: str, path: str, body: bytes, leaks: tuple) -> None:
    where = f"{method} {path} {body[:300]!r} -> {r.status_code} {r.text[:500]}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], where
        for leak in ("Traceback", 'File "', "site-packages", "llama_cpp", ".py", *leaks):
            assert leak not in r.text, (leak, where)
        return
    for leak in leaks:  # an answer is random text, but never the server's paths
        assert leak not in r.text, (leak, where)
    if r.headers["content-type"].startswith("text/event-stream"):
        assert "data: [DONE]" in r.text, where  # a stream that started also finished
    elif path in (CHAT, COMP):
        assert r.json()["model"] == "tiny", where


# A crash poisons every later example, and shrinking would then report a harmless one: keep the first failure.
@settings(max_examples=150, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(req=REQUESTS)
# what crashed or broke the server before serve_guard.py (segfault, stack overflow, 500, a 200 with an empty stream)
@example(req=("POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "grammar": "garbage ::="}'))
@example(req=("POST", "/extras/detokenize", b'{"tokens": [99999999]}'))
@example(req=("POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}'))
@example(req=("POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, '
                            b'"logit_bias": {"abc": 1}}'))
@example(req=("POST", COMP, b'{"prompt": [1, 2, 3]}'))
@example(req=("POST", CHAT, b'{"messages": [{"role": {"a": 1}, "content": "hi"}]}'))  # a 500 (found by CI's run)
@example(req=("POST", CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}], "response_format": {
    "type": "json_object", "schema": {"type": "string", "maxLength": 30000}}}).encode()))  # stack overflow
@example(req=("POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + b'[' * 900 + b']' * 900
              + b'}'))  # nested just under the JSON decoder's recursion limit
@example(req=("POST", COMP, json.dumps({"prompt": "red cat " * 300, "stream": True}).encode()))
def test_fuzzed_requests_never_get_a_5xx_and_the_server_stays_up(stress_server, req):
    base, proc, log = stress_server
    method, path, body = req
    r = httpx.request(method, base + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert proc.poll() is None, f"the server died on {method} {path} {body[:300]!r}:\n{log.read_text()[-3000:]}"
    _check_response(r, method, path, body, leaks=(str(log.parent),))


# --- load -----------------------------------------------------------------------------------------------------

PROMPTS = [f"Repeat after me: {w}" for w in ("red cat", "blue dog", "green owl", "tall tree", "warm sun")]


def test_hundred_concurrent_mixed_requests(stress_server):
    """40 chat, 30 streamed chat, 10 completions, 5 streamed completions, 14 clients that hang up mid-stream and
    one slow reader, all at once, twice: greedy answers equal the same requests made one at a time, the first
    round's peak RSS stays within RSS_BOUND of the warmed-up server's, and the second round adds nothing."""
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    base, proc, _ = stress_server
    kinds = ["chat"] * 40 + ["chat_stream"] * 30 + ["comp"] * 10 + ["comp_stream"] * 5 + ["hang_up"] * 14 + ["slow"]

    async def run():
        # a connection per request: uvicorn closes a keep-alive connection after 5 s idle, and a client that reuses
        # one just then gets a ReadError (the keep-alive race; the openai client's default retries hide it)
        oai = AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0,
                          http_client=DefaultAsyncHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0)))
        raw = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0))

        async def chat(p, mt, stream):
            kw = dict(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=mt, temperature=0)
            if not stream:
                return (await oai.chat.completions.create(**kw)).choices[0].message.content
            return "".join([c.choices[0].delta.content or "" async for c in await oai.chat.completions.create(
                stream=True, **kw) if c.choices])

        async def comp(p, mt, stream):
            kw = dict(model="tiny", prompt=p, max_tokens=mt, temperature=0)
            if not stream:
                return (await oai.completions.create(**kw)).choices[0].text
            return "".join([c.choices[0].text async for c in await oai.completions.create(stream=True, **kw)
                            if c.choices])

        async def raw_stream(p, mt, stop_after=None, pause=0.0):
            text, n = "", 0
            async with raw.stream("POST", base + CHAT, json={"model": "tiny", "messages": [
                    {"role": "user", "content": p}], "max_tokens": mt, "temperature": 0, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        if stop_after and n >= stop_after:
                            return None  # leaving the block closes the connection mid-stream
                        await asyncio.sleep(pause)
            return text

        async def one(i, kind):
            try:
                return await one_kind(i, kind)
            except Exception as e:  # every failure in the report, not only the first
                return kind, PROMPTS[i % len(PROMPTS)], f"{type(e).__name__}: {e!r} {e.__cause__!r}"

        async def one_kind(i, kind):
            p = PROMPTS[i % len(PROMPTS)]
            if kind.startswith("chat"):
                return kind, p, await chat(p, 16, kind == "chat_stream")
            if kind.startswith("comp"):
                return kind, p, await comp(p, 16, kind == "comp_stream")
            if kind == "hang_up":
                return kind, p, await raw_stream(p, CAP, stop_after=2)
            return kind, p, await raw_stream(p, CAP, pause=0.02)  # the slow reader

        reference = {}
        for p in PROMPTS:  # one at a time, warming the server up
            reference["chat", p] = await chat(p, 16, False)
            reference["comp", p] = await comp(p, 16, False)
            reference["slow", p] = await chat(p, CAP, False)
        rounds = []
        for _ in range(2):
            rss = _rss(proc.pid, "VmRSS")
            with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
                f.write("5")  # resets the peak (VmHWM) to the current RSS
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*(one(i, k) for i, k in enumerate(kinds))), timeout=300)
            rounds.append((results, rss, _rss(proc.pid, "VmHWM"), time.monotonic() - t0))
        again = {p: await chat(p, 16, False) for p in PROMPTS}  # after the hang-ups, still the same answers
        await oai.close()
        await raw.aclose()
        return reference, rounds, again

    reference, rounds, again = asyncio.run(run())
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    for i, (_, rss, peak, wall) in enumerate(rounds):
        print(f"\nload round {i + 1}: 100 requests in {wall:.1f} s; server RSS {mib(rss)} before, peak {mib(peak)}")
    for results, *_ in rounds:
        assert len(results) == 100
        wrong = [(kind, p, text) for kind, p, text in results
                 if kind != "hang_up" and text != reference[kind.split("_")[0], p]]
        assert not wrong, wrong
    assert again == {p: reference["chat", p] for p in PROMPTS}
    (_, before, peak1, _), (_, _, peak2, _) = rounds
    assert peak1 - before <= RSS_BOUND, f"peak {mib(peak1)} over {mib(before)}"
    assert peak2 - peak1 <= RSS_GROWTH, f"the same load again: peak {mib(peak2)} after {mib(peak1)}"
    assert proc.poll() is None and httpx.get(base + "/v1/models", timeout=10).status_code == 200


# --- the queue limit ------------------------------------------------------------------------------------------

def test_requests_over_the_queue_get_429_with_retry_after(tiny_gguf, tmp_path):
    """serve.max_queue=1: one request generating, one waiting; of 12 sent at once the rest are refused. Then the
    `openai` client, which honours Retry-After, gets all of 6 concurrent requests through."""
    from openai import AsyncOpenAI

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Repeat after me: red cat"}],
            "max_tokens": CAP, "temperature": 0}
    with _serve(tmp_path, tiny_gguf, "serve.max_queue=1") as (base, proc, log):
        async def burst():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(base + CHAT, json=body) for _ in range(12)))

        async def polite():
            oai = AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=8)
            res = await asyncio.gather(*(oai.chat.completions.create(**body) for _ in range(6)))
            await oai.close()
            return res

        rs = asyncio.run(burst())
        busy = [r for r in rs if r.status_code == 429]
        done = [r for r in rs if r.status_code == 200]
        assert busy and done and len(busy) + len(done) == 12, [r.status_code for r in rs]
        for r in busy:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "busy" in r.json()["error"]["message"]
        assert len({r.json()["choices"][0]["message"]["content"] for r in done}) == 1
        res = asyncio.run(polite())
        assert [r.usage.completion_tokens for r in res] == [CAP] * 6
        assert res[0].choices[0].message.content == done[0].json()["choices"][0]["message"]["content"]


@pytest.mark.extended
def test_rss_stays_flat_over_repeated_loads(tiny_gguf, tmp_path):
    """Five rounds of 100 concurrent 64-token chat requests on a fresh server: no round after the first raises the
    peak RSS by more than RSS_GROWTH. Without serve's fixed mmap threshold each round kept ~150 MiB more of freed
    memory (serve.return_large_frees_to_the_os); the CI load test's shorter answers do not show it."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Repeat after me: red cat"}],
            "max_tokens": CAP, "temperature": 0}

    async def burst(base):
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            rs = await asyncio.gather(*(c.post(base + CHAT, json=dict(body, stream=i % 2 == 1)) for i in range(100)))
        assert [r.status_code for r in rs] == [200] * 100

    with _serve(tmp_path, tiny_gguf, "serve.max_queue=128") as (base, proc, _):
        peaks = []
        for _ in range(5):
            asyncio.run(burst(base))
            peaks.append(_rss(proc.pid, "VmHWM"))
        print(f"\nRSS peaks over 5 rounds: {[round(p / 2**20) for p in peaks]} MiB")
        assert max(peaks[1:]) - peaks[0] <= RSS_GROWTH, [round(p / 2**20) for p in peaks]
