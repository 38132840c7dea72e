"""What the body and fields of a request to `zerotune serve` must be before llama-cpp-python sees it (steps 3 and 4
of serve_guard.py's list), and what a refusal is: `ApiError`, one OpenAI-shaped body naming the field.

3. the body: UTF-8 JSON without NaN/Infinity, nested at most MAX_DEPTH levels (`parse_body`; its size,
   serve.max_request_kb, is counted by the guard as it reads it);
4. the fields: llama-cpp-python's own request models in strict mode (the same types its routes use, so what
   passes here passes there), then zerotune's rules for what those types let through (`check_chat`,
   `check_completion`): unknown or unsupported parameters refused by name (`grammar` among them), ranges,
   max_tokens <= serve.max_tokens, JSON schemas that become grammars small enough to convert and parse.

llama_cpp and pydantic are imported by the checks that use them, so `zerotune serve`'s import of the guard stays light.
"""

from __future__ import annotations

import functools
import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
# OpenAI parameters llama-cpp-python's request models do not declare, handled here and removed from the body
CHAT_ALIASES = {"max_completion_tokens", "stream_options", "parallel_tool_calls"}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; each one is a sort over the vocabulary per token
INT32 = 2**31 - 1
MAX_DEPTH = 64  # nesting of the request's JSON; a real one stays under 20, and every later step recurses over it
# A JSON schema that becomes a grammar (response_format.schema, the parameters of the tool tool_choice names):
# llama-cpp-python's converter writes lengths and counts out one by one (maxLength 10^8: an 800 MB grammar), and
# llama.cpp's parser refuses a bounded repetition of a few thousand and crashes on one of 30,000 (measured).
SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
MAX_SCHEMA_COUNT = 1000  # each length or count
MAX_SCHEMA_TOTAL = 10_000  # all of them together
MAX_SCHEMA_BYTES = 16 * 1024  # the schema as JSON
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # {m} or {m,n} in a pattern


class ApiError(Exception):
    """A request refused, with the status and OpenAI-shaped body it gets."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                     "code": self.code}}).encode()


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class Limits:
    alias: str  # the one model name served (/v1/models); a request naming another gets 404
    api_key: str | None
    max_request_bytes: int
    max_tokens: int
    max_queue: int


# --- 3. the body --------------------------------------------------------------------------------------------

def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e999 parses to inf: no sampler parameter means that
        raise ValueError(f"number out of range: {text[:40]}")
    return x


def _no_constant(name: str):  # NaN, Infinity: Python's json takes them, JSON does not
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("The request body is not UTF-8.")
    try:
        body = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        body = None
    except ValueError as e:  # JSONDecodeError included: its message names line and column, nothing of ours
        raise bad(f"The request body is not valid JSON: {e}")
    level, depth = [body], 0
    while level:  # breadth first, so no recursion here either
        depth += 1
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
    if body is None and text.strip() != "null" or depth > MAX_DEPTH:
        raise bad(f"The request body is nested too deeply (at most {MAX_DEPTH} levels).")
    return body


def encode_body(body: dict) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a "\ud800" escape: a lone surrogate, which llama.cpp's tokenizer cannot take
        raise bad("The request contains invalid Unicode (a lone surrogate escape).")


# --- 4. the fields ------------------------------------------------------------------------------------------

@functools.cache
def _message_types() -> dict:
    """role -> a validator of llama-cpp-python's TypedDict for a message with that role (its own union)."""
    from llama_cpp import llama_types
    from pydantic import TypeAdapter

    return {typing.get_args(typing.get_type_hints(t)["role"])[0]: TypeAdapter(t)
            for t in typing.get_args(llama_types.ChatCompletionRequestMessage)}


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _from_pydantic(e, data: Any, prefix: tuple = ()) -> ApiError:
    """One message from pydantic's errors: the deepest field they name in the request (union-member tags such
    as 'list[str]' are skipped by walking the request itself), and what each union member expected there."""
    found = []
    for err in e.errors(include_url=False):
        node, path = data, []
        for i, part in enumerate(err["loc"]):
            if isinstance(node, dict) and part in node:
                node, path = node[part], path + [part]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node, path = node[part], path + [part]
            elif err["type"] == "missing" and i == len(err["loc"]) - 1:
                path.append(part)
        found.append((len(path), _path(prefix + tuple(path)), err))
    depth = max(d for d, _, _ in found)
    here = [(p, err) for d, p, err in found if d == depth]
    param = here[0][0]
    if all(err["type"] == "missing" for _, err in here):
        return bad(f"Missing required parameter: '{param}'.", param)
    msgs = list(dict.fromkeys(err["msg"] for _, err in here if err["type"] != "missing"))
    return bad(f"Invalid value for '{param}': {' or '.join(msgs)}.", param)


def _validate(model, data: dict, prefix: tuple = ()):
    from pydantic import TypeAdapter, ValidationError

    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data, strict=True)
        return model.model_validate(data, strict=True)  # strict: "0.5" is not a number, "yes" not a boolean
    except ValidationError as e:
        raise _from_pydantic(e, data, prefix)


def _text(content, where: str):
    """Message content as a string: text parts joined with a newline (as vLLM does); images refused."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"Invalid value for '{where}[{j}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                      f"are supported; this model takes no images.", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise bad("Invalid value for 'messages': expected a non-empty array of messages.", "messages")
    types, out = _message_types(), []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"Invalid value for '{where}': expected an object with 'role' and 'content'.", where)
        m = dict(m)
        if m.get("role") == "developer":  # OpenAI's newer name for the system turn
            m["role"] = "system"
        if not isinstance(m.get("role"), str) or m["role"] not in types:  # a dict or list is no role (nor hashable)
            raise bad(f"Invalid value for '{where}.role': {json.dumps(m.get('role'))[:40]} is not one of "
                      f"{sorted([*types, 'developer'])}.", f"{where}.role")
        if m["role"] == "assistant":
            if m.get("content", "") is None:
                del m["content"]  # OpenAI's tool-call turn has content null; llama-cpp-python's type wants it absent
        elif m.get("content") is None:  # llama-cpp-python's types allow null, which a template renders as "None"
            raise bad(f"Missing required parameter: '{where}.content' (a string).", f"{where}.content")
        if "content" in m:
            m["content"] = _text(m["content"], f"{where}.content")
        _validate(types[m["role"]], m, ("messages", i))
        if m["role"] == "assistant" and "content" not in m and not m.get("tool_calls"):
            raise bad(f"Missing required parameter: '{where}.content' (an assistant turn needs content or "
                      f"tool_calls).", f"{where}.content")
        out.append(m)
    return out


def _unknown(body: dict, known: set) -> None:
    for key in body:
        if key not in known:
            raise bad(f"Unrecognized request argument supplied: {key}", key)


def _common(body: dict, limits: Limits, default_cap: bool) -> None:
    """Rules shared by both generation endpoints, on the request as llama-cpp-python typed it."""
    if body.get("grammar") is not None:  # 10^5 nested groups or chained rules crash llama.cpp's parser (measured)
        raise bad("'grammar' (a llama.cpp extension) is not accepted here: llama.cpp's grammar parser can be crashed "
                  "by a hostile grammar. Use response_format {\"type\": \"json_object\", \"schema\": ...} or a "
                  "tool_choice naming a function.", "grammar")
    model = body.get("model")
    if model is None:
        body["model"] = limits.alias  # else the answer's "model" is the GGUF's path on the server
    elif model != limits.alias:
        raise ApiError(404, f"The model '{str(model)[:80]}' does not exist; this server serves '{limits.alias}'.",
                       "model", "model_not_found")
    # OpenAI's API has no repetition penalty; llama-cpp-python's request models default it to 1.1, which changes
    # even greedy answers (SmolLM2 + LoRA: 4 of 20 task answers differed from `zerotune check`'s, which llama.cpp
    # gives at 1.0). What a client does not ask for it does not get: the answers served are the ones checked.
    body.setdefault("repeat_penalty", 1.0)
    if body.get("n") not in (None, 1):
        raise bad(f"Invalid value for 'n': this server returns one choice per request (n=1); got {body['n']}.", "n")
    if body.get("best_of") not in (None, 1):
        raise bad(f"Invalid value for 'best_of': only 1 is supported; got {body['best_of']}.", "best_of")
    mt = body.get("max_tokens")
    if mt is None and (default_cap or "max_tokens" in body):
        body["max_tokens"] = limits.max_tokens  # llama-cpp-python reads none as "until the context is full"
    elif mt is not None and not 1 <= mt <= limits.max_tokens:
        raise bad(f"Invalid value for 'max_tokens': {mt} is outside 1..{limits.max_tokens} "
                  f"(this server's limit).", "max_tokens")
    if not 0 <= body.get("temperature", 0) <= 2:
        raise bad(f"Invalid value for 'temperature': {body['temperature']} is outside 0..2.", "temperature")
    seed = body.get("seed")
    if seed is not None and not 0 <= seed < 2**32:  # llama.cpp's seed is a uint32
        raise bad(f"Invalid value for 'seed': {seed} is outside 0..{2**32 - 1}.", "seed")
    for key, top in (("top_k", INT32), ("min_tokens", INT32), ("logprobs", MAX_TOP_LOGPROBS),
                     ("top_logprobs", MAX_TOP_LOGPROBS)):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= top:
            raise bad(f"Invalid value for '{key}': {v} is outside 0..{top}.", key)
    bias = body.get("logit_bias")
    if bias and body.get("logit_bias_type") != "tokens":
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit()):
                raise bad(f"Invalid value for 'logit_bias': keys are token ids; got {k[:40]!r}.", "logit_bias")
            if not -100 <= v <= 100:
                raise bad(f"Invalid value for 'logit_bias': bias {v} for token {k} is outside -100..100.",
                          "logit_bias")


def _schema_counts(node, path: str):
    """(where, n) for every length or count a JSON schema asks for: the keywords, and {m,n} in patterns."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in SCHEMA_COUNTS and isinstance(v, (int, float)) and not isinstance(v, bool):
                yield f"{path}.{k}", v
            elif k == "pattern" and isinstance(v, str):
                for m in _REPEAT.finditer(v):
                    yield f"{path}.pattern", max(int(x) if len(x) < 10 else 10**10 for x in m.groups() if x)
            else:
                yield from _schema_counts(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _schema_counts(v, f"{path}[{i}]")


def check_grammar_schema(schema, param: str) -> None:
    """A schema llama-cpp-python will turn into a grammar is small enough for its converter and llama.cpp."""
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise bad(f"Invalid value for '{param}': a schema that constrains the answer may take at most "
                  f"{MAX_SCHEMA_BYTES // 1024} KiB as JSON.", param)
    total = 0
    for where, n in _schema_counts(schema, param):
        total += n
        if n > MAX_SCHEMA_COUNT or total > MAX_SCHEMA_TOTAL:
            raise bad(f"Invalid value for '{where}': {n} is over this server's limit for a schema that constrains "
                      f"the answer (each length or count at most {MAX_SCHEMA_COUNT}, all together at most "
                      f"{MAX_SCHEMA_TOTAL}); llama.cpp builds a grammar rule for each one.", where)


def check_chat(body: Any, limits: Limits) -> dict:
    """A chat request as llama-cpp-python will receive it (normalized), or ApiError naming the field."""
    from llama_cpp.server.types import CreateChatCompletionRequest

    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    _unknown(body, set(CreateChatCompletionRequest.model_fields) | CHAT_ALIASES)
    if "messages" not in body:
        raise bad("Missing required parameter: 'messages'.", "messages")
    body = dict(body, messages=_messages(body["messages"]))
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise bad(f"'{key}' is deprecated by OpenAI and not supported here: use 'tools' and 'tool_choice'.", key)
    mct = body.pop("max_completion_tokens", None)
    if mct is not None:
        if body.get("max_tokens") not in (None, mct):
            raise bad("Give 'max_tokens' or 'max_completion_tokens', not both with different values.",
                      "max_completion_tokens")
        body["max_tokens"] = mct
    opts = body.pop("stream_options", None)
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or opts.get("include_usage") not in (None, False)):
        raise bad("Invalid value for 'stream_options': only {\"include_usage\": false} is supported "
                  "(streamed answers carry no usage chunk).", "stream_options")
    ptc = body.pop("parallel_tool_calls", None)  # at most one call per answer satisfies either value
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("Invalid value for 'parallel_tool_calls': expected a boolean.", "parallel_tool_calls")
    for i, tool in enumerate(body["tools"] if isinstance(body.get("tools"), list) else []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and "parameters" not in fn:  # OpenAI: omitted = takes no arguments
            body["tools"][i] = dict(tool, function=dict(fn, parameters={"type": "object", "properties": {}}))
    req = _validate(CreateChatCompletionRequest, body)
    _common(body, limits, default_cap=True)
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise bad("'tool_choice' is only allowed when 'tools' are given.", "tool_choice")
    if choice == "required":  # llama-cpp-python renders it into the prompt but does not enforce it
        raise bad("tool_choice 'required' is not enforced by this server: name the function instead, "
                  "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    if isinstance(choice, dict):
        names = [t["function"]["name"] for t in req.tools]
        if choice["function"]["name"] not in names:
            raise bad(f"Invalid value for 'tool_choice': no tool named {choice['function']['name']!r} in 'tools'.",
                      "tool_choice.function.name")
        i = names.index(choice["function"]["name"])
        check_grammar_schema(req.tools[i]["function"]["parameters"], f"tools[{i}].function.parameters")
    if req.response_format and "schema" in req.response_format:
        check_grammar_schema(req.response_format["schema"], "response_format.schema")
    return body


def check_completion(body: Any, limits: Limits) -> dict:
    from llama_cpp.server.types import CreateCompletionRequest

    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    _unknown(body, set(CreateCompletionRequest.model_fields))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if (prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)) or \
                any(isinstance(p, list) for p in prompt):
            raise bad("Invalid value for 'prompt': token-id prompts are not supported by this server; send the "
                      "prompt as a string.", "prompt")
        if len(prompt) > 1:
            raise bad("Invalid value for 'prompt': one prompt per request (batches of prompts are not supported).",
                      "prompt")
        if prompt:
            body = dict(body, prompt=prompt[0])  # llama-cpp-python unwraps a one-item list the same way
    if body.get("prompt") in (None, "", []):
        raise bad("Missing required parameter: 'prompt' (a non-empty string).", "prompt")
    if body.get("suffix") is not None:  # llama-cpp-python 0.3.36 inserts token 0 for it ("TODO: Fix")
        raise bad("'suffix' (insert mode) is not supported by this server.", "suffix")
    _validate(CreateCompletionRequest, body)
    _common(body, limits, default_cap=False)
    return body
