"""Formats -> chat messages -> exact token ids and assistant-only label masks (real Llama-3.1 tokenizer)."""

from __future__ import annotations

import copy

import pytest

from zerotune.data.formats import to_messages
from zerotune.data.tokenize import (IGNORE, ChatRenderer, TemplateError, encode_batch, encode_chat, encode_text,
                                    require_chat_template)
from zerotune.errors import BadSample

BOS, SH, EH, EOT, NL2 = 128000, 128006, 128007, 128009, 271  # <|begin_of_text|> <|start_header_id|> ... "\n\n"
ROLE_IDS = {"system": [9125], "user": [882], "assistant": [78191]}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye now."},
]


def template_ids(tok, msgs):
    out = tok.apply_chat_template(msgs, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def build(tok, msgs, label_turns):
    """Independent construction from pieces: header tokens never labelled, content + <|eot_id|> of label_turns."""
    ids, labels = [BOS], [IGNORE]
    for i, m in enumerate(msgs):
        head = [SH] + ROLE_IDS[m["role"]] + [EH, NL2]
        body = tok.encode(m["content"].strip(), add_special_tokens=False) + [EOT]
        ids += head + body
        labels += [IGNORE] * len(head) + (body if i in label_turns else [IGNORE] * len(body))
    return ids, labels


@pytest.mark.slow
def test_messages_multiturn_with_system_exact(tokenizer):
    ids, labels = encode_chat(tokenizer, CHAT, "all_assistant", "t")
    assert ids == [128000, 128006, 9125, 128007, 271, 3513, 10015, 13, 128009, 128006, 882, 128007, 271, 13347,
                   128009, 128006, 78191, 128007, 271, 9906, 0, 128009, 128006, 882, 128007, 271, 1383, 68, 128009,
                   128006, 78191, 128007, 271, 1383, 68, 1457, 13, 128009]
    assert labels == [IGNORE] * 19 + [9906, 0, 128009] + [IGNORE] * 11 + [1383, 68, 1457, 13, 128009]
    assert ids == template_ids(tokenizer, CHAT)
    assert (ids, labels) == build(tokenizer, CHAT, {2, 4})


def test_last_assistant_only_labels_final_turn(tokenizer):
    ids, labels = encode_chat(tokenizer, CHAT, "last_assistant", "t")
    assert ids == template_ids(tokenizer, CHAT)
    assert (ids, labels) == build(tokenizer, CHAT, {4})
    assert labels == [IGNORE] * 33 + [1383, 68, 1457, 13, 128009]


def test_instruction_with_and_without_input(tokenizer):
    with_input = to_messages({"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
                             "instruction", {}, "t")
    assert with_input == [{"role": "user", "content": "Translate to French.\n\nGood morning"},
                          {"role": "assistant", "content": "Bonjour"}]
    ids, labels = encode_chat(tokenizer, with_input, "all_assistant", "t")
    assert ids == template_ids(tokenizer, with_input)
    assert (ids, labels) == build(tokenizer, with_input, {1})
    bonjour = tokenizer.encode("Bonjour", add_special_tokens=False)
    assert [x for x in labels if x != IGNORE] == bonjour + [EOT]

    for extra in ({}, {"input": ""}, {"input": None}):
        msgs = to_messages({"instruction": "Say hi.", "output": "hi", **extra}, "instruction", {}, "t")
        assert msgs == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    # optional system column
    msgs = to_messages({"instruction": "Say hi.", "output": "hi", "system": "Be kind."}, "instruction", {}, "t")
    assert msgs[0] == {"role": "system", "content": "Be kind."}


def test_prompt_completion_exact(tokenizer):
    msgs = to_messages({"prompt": "2+2?", "completion": "4"}, "prompt_completion", {}, "t")
    ids, labels = encode_chat(tokenizer, msgs, "all_assistant", "t")
    assert ids == template_ids(tokenizer, msgs)
    assert (ids, labels) == build(tokenizer, msgs, {1})
    four = tokenizer.encode("4", add_special_tokens=False)
    assert [x for x in labels if x != IGNORE] == four + [EOT]


def test_text_format(tokenizer):
    assert to_messages({"text": "Hello world"}, "text", {}, "t") == "Hello world"
    ids, labels = encode_text(tokenizer, "Hello world")
    assert ids == [BOS, 9906, 1917, EOT]
    assert labels == [IGNORE, 9906, 1917, EOT]  # first token never a label: nothing in the document predicts it


def test_column_mapping(tokenizer):
    row = {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert to_messages(row, "messages", {"messages": "conversations"}, "t")[1]["content"] == "b"
    row = {"question": "q", "answer": "a"}
    assert to_messages(row, "prompt_completion", {"prompt": "question", "completion": "answer"}, "t")[0]["content"] == "q"


def test_messages_as_json_string_cell():
    row = {"messages": '[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]'}
    assert len(to_messages(row, "messages", {}, "t")) == 2


def test_batch_equals_single_and_renderer_equals_template(tokenizer):
    render = ChatRenderer(tokenizer)
    for gen in (False, True):
        assert render(CHAT[:3], gen) == tokenizer.apply_chat_template(CHAT[:3], tokenize=False, add_generation_prompt=gen)
    items = [("a", CHAT, "all_assistant", None), ("b", CHAT, "last_assistant", None),
             ("c", "Some text.", "all_assistant", None), ("d", CHAT[1:3], "all_assistant", None)]
    batch = encode_batch(tokenizer, render, items)
    for (where, conv, loss_on, _), (ids, labels) in zip(items, batch):
        ref = encode_text(tokenizer, conv) if isinstance(conv, str) else encode_chat(tokenizer, conv, loss_on, where)
        assert (ids.tolist(), labels.tolist()) == ref


def test_assistant_content_with_leading_newline_still_matches_template(tokenizer):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n\n  indented\n"}]
    ids, labels = encode_chat(tokenizer, msgs, "all_assistant", "t")
    assert ids == template_ids(tokenizer, msgs)
    assert labels[-1] == EOT and any(x != IGNORE for x in labels[:-1])


@pytest.mark.parametrize("row, fmt, columns, needle, fix", [
    ({"messages": [{"role": "human", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages", {},
     "unknown role 'human'", "probably 'user'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]}, "messages", {},
     "message 1 (assistant) content is empty", "fill in the content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}, "messages", {},
     "no assistant turn", "add an assistant reply"),
    ({"messages": []}, "messages", {}, "non-empty list", ""),
    ({"messages": [{"role": "user", "content": "a"}, {"from": "gpt", "value": "b"}]}, "messages", {},
     "message 1 must be an object with 'role' and 'content'", "columns: {role: <your key>"),
    ({"conversations": [{"role": "user", "content": "a"}]}, "messages", {}, "missing field 'messages'",
     "columns: {messages: conversations}"),
    ({"instruction": "i", "response": "o"}, "instruction", {}, "missing field 'output'", "columns: {output: response}"),
    ({"prompt": "p", "completion": 3}, "prompt_completion", {}, "must be a string", ""),
    ({"text": ""}, "text", {}, "text is empty", ""),
    ({"question": "q", "completion": "c"}, "prompt_completion", {"prompt": "query"}, "missing field 'query'",
     "columns: {prompt: question}"),
])
def test_bad_rows_name_where_and_fix(row, fmt, columns, needle, fix):
    with pytest.raises(BadSample) as e:
        to_messages(row, fmt, columns, "data/x.jsonl line 7")
    msg = str(e.value)
    assert msg.startswith("data/x.jsonl line 7: ") and needle in msg and fix in msg


@pytest.mark.slow
def test_tokenizer_without_chat_template(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template.*format: text"):
        require_chat_template(tok, "my/tokenizer")
    require_chat_template(tokenizer, "ok")  # no error


@pytest.mark.slow
def test_template_that_rejects_a_conversation_is_a_bad_sample(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                         "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    render = ChatRenderer(tok)
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ids, labels = encode_chat(tok, ok, "all_assistant", "t", render=render)
    # "assistant: b" tokenizes as ..."assistant", ":", " b": the token straddling the prompt/reply boundary is a label
    assert tok.decode([x for x in labels if x != IGNORE]) == " b\n"
    with pytest.raises(BadSample, match=r"^f line 2: the chat template rejected.*must alternate.*Fix: "):
        encode_chat(tok, [{"role": "assistant", "content": "b"}], "all_assistant", "f line 2", render=render)
