"""What a request to `zerotune serve` must be for the loaded model (step 5 of serve_guard.py's list): the chat template
renders the conversation, the prompt fits the context, every grammar the request implies parses in llama.cpp (checked
with the same parser, so none reaches the sampler as NULL), and logit_bias names tokens of the vocabulary.
"""

from __future__ import annotations

import json

from .serve_request import CHAT, bad


class ModelFacts:
    """What the checks need from the loaded model: its chat template (rendered as llama-cpp-python's handler
    renders it), its tokenizer, context and vocabulary, and llama.cpp's grammar parser."""

    def __init__(self, llm):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm, self.n_ctx = llm, llm.n_ctx()
        self.vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        eos, bos = llm.token_eos(), llm.token_bos()
        # built exactly as Llama.__init__ builds the "chat_template.default" handler's formatter (llama.py)
        self.formatter = Jinja2ChatFormatter(
            template=llm.metadata["tokenizer.chat_template"],
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "", stop_token_ids=[eos])

    def grammar_parses(self, grammar) -> bool:
        import llama_cpp

        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, grammar._grammar.encode("utf-8"),
                                                       grammar._root.encode("utf-8"))
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def check(self, path: str, body: dict) -> None:
        """Template, context and grammars, as llama-cpp-python will meet them; runs in a worker thread."""
        from llama_cpp import llama_chat_format

        grammars = []
        if path == CHAT:
            try:
                prompt = self.formatter(messages=body["messages"], tools=body.get("tools"),
                                        tool_choice=body.get("tool_choice")).prompt
            except Exception as e:  # raise_exception() in the template, or a jinja error on this conversation
                raise bad(f"The model's chat template cannot render these messages: {str(e)[:300]}", "messages")
            tokens = self.llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)  # as the handler does
            rf = body.get("response_format")
            if rf:
                grammars.append(("response_format", llama_chat_format._grammar_for_response_format(rf)))
            choice = body.get("tool_choice")
            if isinstance(choice, dict):
                tool = next(t for t in body["tools"] if t["function"]["name"] == choice["function"]["name"])
                # the handler's own fallback: a schema the converter rejects becomes plain JSON
                grammars.append(("tool_choice", llama_chat_format._grammar_for_json_schema(
                    json.dumps(tool["function"]["parameters"]))))
            where = "messages"
        else:
            tokens = self.llm.tokenize(body["prompt"].encode("utf-8"), add_bos=True, special=True)
            where = "prompt"
        if len(tokens) >= self.n_ctx:
            raise bad(f"This model's maximum context length is {self.n_ctx} tokens; the prompt "
                      f"{'built from the messages ' if path == CHAT else ''}is {len(tokens)} tokens.", where,
                      "context_length_exceeded")
        for param, g in grammars:
            if g is not None and not self.grammar_parses(g):
                raise bad(f"Invalid value for '{param}': llama.cpp cannot parse the grammar this schema becomes "
                          f"(it refuses long repetitions, among others).", param)
        bias = body.get("logit_bias")
        if bias and body.get("logit_bias_type") != "tokens":
            for k in bias:
                if int(k) >= self.n_vocab:
                    raise bad(f"Invalid value for 'logit_bias': token id {k} is outside the vocabulary "
                              f"(0..{self.n_vocab - 1}).", "logit_bias")
