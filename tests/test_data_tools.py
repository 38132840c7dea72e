"""Data as people have it: the OpenAI chat fine-tuning format (per-turn weight, tools, tool calls, tool replies),
ShareGPT (native, detected, mapped), and every key accounted for. Labels are checked against the chat template's
own assistant mask ({% generation %}, transformers' return_assistant_tokens_mask) on SmolLM2's tokenizer."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import REPO
from zerotune.config import RecipeError, from_dict
from zerotune.data.formats import read_row
from zerotune.data.tokenize import IGNORE, ChatRenderer, encode_chat
from zerotune.errors import BadSample

SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"

# SmolLM2's ChatML with tools, tool calls and tool replies (the layout Qwen2.5's template uses), and
# {% generation %} around what an assistant turn generates. No shipped template has generation markers (and only
# Qwen3's renders tools: SHIPPED below), so the reference is built here.
CHATML_TOOLS = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'You may call these tools:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls | default([]) %}
{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endgeneration %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role != 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
OPENAI_ROW = {  # OpenAI's chat fine-tuning format, as their docs show it
    "messages": [
        {"role": "system", "content": "You call tools when they help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"},
        {"role": "assistant", "content": "It is 21 degrees in Paris.", "weight": 1},
        {"role": "user", "content": "Thanks!", "name": "bob"},
        {"role": "assistant", "content": "You're welcome.", "weight": 0},
    ],
    "tools": [WEATHER],
    "parallel_tool_calls": False,
}
SHAREGPT_ROW = {  # the same conversation as LLaMA-Factory's ShareGPT layout writes it
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"},
        {"from": "observation", "value": "{\"temp_c\": 21}"},
        {"from": "gpt", "value": "It is 21 degrees in Paris."},
        {"from": "human", "value": "Thanks!"},
        {"from": "gpt", "value": "You're welcome.", "weight": 0},
    ],
    "system": "You call tools when they help.",
    "tools": json.dumps([WEATHER["function"]]),  # a JSON string of bare {name, description, parameters}
}


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.fail(f"{SMOLLM2} missing: run `make setup`")
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    tok.chat_template = CHATML_TOOLS
    return tok


def template_mask(tok, msgs, tools):
    out = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def runs(mask) -> list[tuple[int, int]]:
    """The [start, end) of each run of 1s: one {% generation %} block, i.e. one assistant turn, in order."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def labelled(tok, labels) -> str:
    return tok.decode([x for x in labels if x != IGNORE])


@pytest.mark.parametrize("loss_on", ["all_assistant", "last_assistant"])
def test_labels_equal_the_templates_assistant_mask_less_weight_0_turns(smol, loss_on):
    row = copy.deepcopy(OPENAI_ROW)
    row["messages"][-1]["weight"] = 1
    doc = read_row(row, "messages", {}, "t")
    ids, labels = encode_chat(smol, doc.conv, loss_on, "t", render=ChatRenderer(smol), tools=doc.tools)
    ref_ids, mask = template_mask(smol, doc.conv, doc.tools)
    turns = runs(mask)
    assert ids == ref_ids and len(turns) == 3  # the tool call, the answer, the last reply
    keep = turns if loss_on == "all_assistant" else turns[-1:]
    assert [i for i, x in enumerate(labels) if x != IGNORE] == [i for a, b in keep for i in range(a, b)]

    # weight 0 on the last reply: that turn alone loses its labels
    doc = read_row(OPENAI_ROW, "messages", {}, "t")
    ids0, labels0 = encode_chat(smol, doc.conv, "all_assistant", "t", render=ChatRenderer(smol), tools=doc.tools)
    assert ids0 == ids
    assert [i for i, x in enumerate(labels0) if x != IGNORE] == [i for a, b in turns[:2] for i in range(a, b)]
    text = labelled(smol, labels0)
    assert "You're welcome." not in text and "It is 21 degrees in Paris.<|im_end|>" in text
    # the tool call is trained, its arguments as the object templates print (OpenAI stores them as JSON text)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    with pytest.raises(BadSample, match="no assistant turn carries labels.*weight 0"):
        encode_chat(smol, doc.conv, "last_assistant", "t", render=ChatRenderer(smol), tools=doc.tools)


def test_openai_row_keys_honoured_and_the_rest_counted(smol):
    doc = read_row(OPENAI_ROW, "messages", {}, "t")
    assert doc.tools == [WEATHER]
    assert doc.conv[2] == {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}  # null content left out, as apply_chat_template does
    assert doc.conv[3] == {"role": "tool", "content": "{\"temp_c\": 21}", "tool_call_id": "call_1"}
    assert doc.conv[-1]["weight"] == 0 and "weight" not in doc.conv[4] and "name" not in doc.conv[5]
    assert doc.notes == {"tool_call_turns": 1, "message:name": 1, "assistant_turns_weight_0": 1,
                         "rows_with_tools": 1, "row:parallel_tool_calls": 1}
    # a source's tools reach the rows without their own; a row's own replace them
    other = {"type": "function", "function": {"name": "other"}}
    plain = {"messages": OPENAI_ROW["messages"][:2] + [{"role": "assistant", "content": "Sunny."}]}
    assert read_row(plain, "messages", {}, "t", tools=[other]).tools == [other]
    assert read_row(OPENAI_ROW, "messages", {}, "t", tools=[other]).tools == [WEATHER]
    assert read_row(plain, "messages", {}, "t").notes is None  # nothing to count: nothing said


def test_sharegpt_native_detected_and_mapped_equal_the_openai_row(smol):
    render = ChatRenderer(smol)
    ref = read_row(OPENAI_ROW, "messages", {}, "t")
    want = encode_chat(smol, ref.conv, "all_assistant", "t", render=render, tools=ref.tools)
    native = read_row(SHAREGPT_ROW, "sharegpt", {}, "t")
    assert native.tools == [WEATHER]
    assert encode_chat(smol, native.conv, "all_assistant", "t", render=render, tools=native.tools) == want
    assert native.notes == {"tool_call_turns": 1, "assistant_turns_weight_0": 1, "rows_with_tools": 1}

    # the same row under the default format: detected, converted, counted (prepare logs it per source)
    detected = read_row(SHAREGPT_ROW, "messages", {}, "t")
    assert detected.conv == native.conv and detected.notes["detected_sharegpt"] == 1

    # someone else's names: keys through `columns`, roles through `roles` (merged over ShareGPT's)
    theirs = {"dialog": [{"speaker": {"human": "customer", "gpt": "agent"}.get(m["from"], m["from"]),
                          "text": m["value"], **({"weight": 0} if "weight" in m else {})}
                         for m in SHAREGPT_ROW["conversations"]],
              "system": SHAREGPT_ROW["system"], "tools": SHAREGPT_ROW["tools"]}
    mapped = read_row(theirs, "sharegpt", {"messages": "dialog", "role": "speaker", "content": "text"}, "t",
                      roles={"customer": "user", "agent": "assistant"})
    assert mapped.conv == native.conv
    with pytest.raises(BadSample, match=r"unknown role 'customer'.*roles: \{customer: user\}"):
        read_row(theirs, "sharegpt", {"messages": "dialog", "role": "speaker", "content": "text"}, "t")


@pytest.mark.parametrize("message, needle, fix", [
    ({"role": "assistant", "content": "b", "loss": False}, "key 'loss' would change what is trained", "weight"),
    ({"role": "assistant", "content": "b", "train": True}, "key 'train' would change what is trained", "weight"),
    ({"role": "assistant", "content": "b", "weight": 0.5}, "weight 0.5: only 0 or 1", "\"weight\": 0"),
    ({"role": "assistant", "content": "b", "weight": "0"}, "weight '0': only 0 or 1", "\"weight\": 0"),
    ({"role": "assistant", "content": "b", "weight": True}, "weight True: only 0 or 1", "\"weight\": 0"),
    ({"role": "user", "content": "b", "weight": 1}, "1 only on assistant turns", ""),
    ({"role": "user", "content": "b", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
     "'tool_calls' on a user turn", "assistant turns"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "arguments are not valid JSON", "JSON object"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}], "truncated": True},
     "'truncated' must be true or false, on an assistant turn", ""),
    ({"role": "assistant", "content": "b", "function_call": {"name": "f", "arguments": "{}"}},
     "key 'function_call' would change what is trained", "tool_calls"),
    ({"role": "function", "name": "f", "content": "b"}, "unknown role 'function'", "roles:"),
])
def test_keys_that_change_training_are_honoured_or_refused(message, needle, fix):
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ok"}, message]}
    with pytest.raises(BadSample) as e:
        read_row(row, "messages", {}, "data/x.jsonl line 3")
    msg = str(e.value)
    assert msg.startswith("data/x.jsonl line 3: ") and needle in msg and fix in msg and "\n" not in msg


@pytest.mark.parametrize("row, needle", [
    ({"weight": 2.0}, "row key 'weight' would change what is trained"),
    ({"loss": 1}, "row key 'loss' would change what is trained"),
    ({"functions": [{"name": "f"}]}, "row key 'functions'"),
    ({"tools": "[{oops"}, "'tools' holds malformed JSON"),
    ({"tools": [{"description": "no name"}]}, "'tools' item 0 has no function name"),
])
def test_row_keys_that_change_training_are_refused(row, needle):
    with pytest.raises(BadSample, match=needle):
        read_row({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], **row},
                 "messages", {}, "t")
    # what is not a training switch is counted, nulls are absent, and a weight-0 user turn is what happens anyway
    doc = read_row({"messages": [{"role": "user", "content": "a", "weight": 0, "name": None},
                                 {"role": "assistant", "content": "b", "refusal": None, "audio": "x"}],
                    "id": 3, "source": None}, "messages", {}, "t")
    assert doc.notes == {"message:audio": 1, "row:id": 1}


def test_templates_that_cannot_render_tools_are_refused_naming_the_tokenizer(tokenizer, smol):
    from transformers import AutoTokenizer

    shipped = {"assets/tokenizer/llama3_1": tokenizer,
               "assets/models/smollm2-135m-instruct": AutoTokenizer.from_pretrained(str(SMOLLM2))}
    doc = read_row(OPENAI_ROW, "messages", {}, "t")
    for name, tok in shipped.items():
        render = ChatRenderer(tok, name)
        support = render.tool_support()
        # what the shipped templates do: a tool reply is just another role; tools and calls vanish or crash
        assert support["tool replies"] is None and support["tools"] and support["tool calls"], (name, support)
        with pytest.raises(BadSample) as e:
            encode_chat(tok, doc.conv, "all_assistant", "data/t.jsonl line 9", render=render, tools=doc.tools)
        msg = str(e.value)
        assert msg.startswith(f"data/t.jsonl line 9: this conversation has tools, but the chat template of {name} "
                              "does not render them") and "model.tokenizer" in msg and "\n" not in msg
        plain = read_row({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                         "messages", {}, "t")
        encode_chat(tok, plain.conv, "all_assistant", "t", render=render)  # plain chats are unaffected
    assert all(v is None for v in ChatRenderer(smol).tool_support().values())


def test_recipe_columns_roles_and_tools_are_checked_at_load(tmp_path):
    base = {"name": "t", "model": {"init_config": "configs/models/tiny_llama31.json"}}

    def load(src):
        return from_dict({**base, "data": {"sources": [{"path": "data/tiny/train.jsonl", **src}]}})

    with pytest.raises(RecipeError, match=r"columns: 'mesages'.*Did you mean 'messages'"):
        load({"columns": {"mesages": "conversations"}})
    with pytest.raises(RecipeError, match=r"columns: 'role'.*format instruction"):
        load({"format": "instruction", "columns": {"role": "from"}})
    with pytest.raises(RecipeError, match="roles.*for formats messages, sharegpt, preference, openai_preference only"):
        load({"format": "instruction", "roles": {"bot": "assistant"}})
    with pytest.raises(RecipeError, match="roles.*one of"):
        load({"format": "sharegpt", "roles": {"bot": "robot"}})
    with pytest.raises(RecipeError, match=r"data.sources\[0\].tools: 'tools' item 0 has no function name"):
        load({"tools": [{"description": "x"}]})
    src = load({"format": "sharegpt", "roles": {"bot": "assistant"}, "tools": [WEATHER["function"]],
                "columns": {"messages": "dialog", "role": "speaker"}}).data.sources[0]
    assert src.tools == [WEATHER] and src.roles == {"bot": "assistant"}


# What each shipped template does with tools, tool calls and tool replies (ChatRenderer.tool_support): Qwen3's
# renders all three (a tool-call turn given a content string); Llama-3's plain template (the Llama-3.1 tokenizer's)
# and SmolLM2's ChatML print every message's role and content, so a tool reply is one more role and tools and
# calls vanish; Gemma 3's has no tool role at all and refuses a turn that is neither user nor model.
SHIPPED = {
    "assets/tokenizer/qwen3": {"tools": None, "tool calls": None, "tool replies": None},
    "assets/tokenizer/llama3_1": {"tools": "its text leaves them out", "tool calls": "its text leaves them out",
                                  "tool replies": None},
    "assets/models/smollm2-135m-instruct": {"tools": "its text leaves them out",
                                            "tool calls": "its text leaves them out", "tool replies": None},
    "assets/tokenizer/gemma3": {"tools": "its text leaves them out", "tool calls": "its text leaves them out",
                                "tool replies": "it raised TemplateError: Conversation roles must alternate "
                                                "user/assistant/user/assistant/..."},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_tool_calls_reach_each_shipped_template_in_the_form_it_accepts(name):
    """OpenAI's tool-call turn (content null) made Qwen3's template raise (it reads `.content` on every assistant
    turn), and the error then blamed the template for not rendering tool calls. Each shipped template now gets the
    form it accepts: where it renders tools, the conversation renders as apply_chat_template renders that form and
    its labels are exactly the assistant turns, less the weight-0 one; where it does not, the one-line refusal
    says what the template does instead."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(REPO / name))
    render = ChatRenderer(tok, name)
    assert render.tool_support() == SHIPPED[name]
    doc = read_row(OPENAI_ROW, "messages", {}, "t")
    if name != "assets/tokenizer/qwen3":
        feature = next(f for f, why in SHIPPED[name].items() if why)
        with pytest.raises(BadSample) as e:
            encode_chat(tok, doc.conv, "all_assistant", "data/t.jsonl line 9", render=render, tools=doc.tools)
        assert str(e.value).startswith(f"data/t.jsonl line 9: this conversation has {feature}, but the chat template "
                                       f"of {name} does not render them ({SHIPPED[name][feature]}), so they cannot "
                                       f"be trained. Fix: set model.tokenizer to")
        return
    ids, labels = encode_chat(tok, doc.conv, "all_assistant", "t", render=render, tools=doc.tools)
    given = render.in_form(doc.conv)
    assert given[2] == {**doc.conv[2], "content": ""} and given[4] is doc.conv[4]  # the call turn alone changes
    assert ids == list(tok.apply_chat_template(given, tools=doc.tools, tokenize=True, return_dict=True)["input_ids"])
    turns = [tok.decode(labels[a:b]) for a, b in runs([x != IGNORE for x in labels])]
    assert turns == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                     "It is 21 degrees in Paris.<|im_end|>\n"]  # "You're welcome." has weight 0
    # the same row as ShareGPT, and the call as the last turn (rendered in Qwen3's last-turn form, with its empty
    # thinking block): the same labels, the call trained
    sharegpt = read_row(SHAREGPT_ROW, "sharegpt", {}, "t")
    assert encode_chat(tok, sharegpt.conv, "all_assistant", "t", render=render, tools=sharegpt.tools) == (ids, labels)
    ids, labels = encode_chat(tok, doc.conv[:3], "all_assistant", "t", render=render, tools=doc.tools)
    assert [tok.decode(labels[a:b]) for a, b in runs([x != IGNORE for x in labels])] == [
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<|im_end|>\n']


@pytest.mark.slow
def test_a_template_that_prints_arguments_as_they_come_gets_them_as_json_text(smol):
    """Templates that print a call's arguments without `tojson` expect OpenAI's JSON text; given the object they
    would train a Python dict ({'city': 'Paris'})."""
    tok = copy.deepcopy(smol)
    tok.chat_template = CHATML_TOOLS.replace("({'name': call.function.name, 'arguments': call.function.arguments} "
                                             "| tojson)", "'{\"name\": \"' + call.function.name + '\", "
                                                          "\"arguments\": ' ~ call.function.arguments ~ '}'")
    assert tok.chat_template != CHATML_TOOLS
    render = ChatRenderer(tok)
    assert render.tool_support() == {"tools": None, "tool calls": None, "tool replies": None}
    doc = read_row(OPENAI_ROW, "messages", {}, "t")
    given = render.in_form(doc.conv)
    assert given[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    ids, labels = encode_chat(tok, doc.conv, "all_assistant", "t", render=render, tools=doc.tools)
    assert ids == template_mask(tok, given, doc.tools)[0]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in labelled(tok, labels)
