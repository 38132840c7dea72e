"""Batched greedy answers (left padding, attention mask) are the answers of one prompt at a time, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerotune.answering import hf_generate, load_hf

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"

# Different lengths on purpose: in a batch the short prompts are left-padded to the longest one's width.
ROWS = [{"messages": m, "answer": ""} for m in (
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Repeat after me: orange frog tea"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence, no lists."},
     {"role": "user", "content": "What is the capital of France, and which river runs through it?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, please, and say why you picked it."}],
    [{"role": "user", "content": "Write a Python function that returns the square of x."}],
    [{"role": "user", "content": "2+2="}],
    [{"role": "user", "content": "Translate to German: the weather is nice today and we are going for a walk in "
                                 "the park by the lake, then home for dinner."}],
)]


def one_at_a_time(model, tok, stop, rows, max_new_tokens):
    """The reference: each prompt alone, no padding (how answers were generated before batching)."""
    import torch

    out = []
    with torch.no_grad():
        for row in rows:
            enc = tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                 pad_token_id=stop[0], temperature=None, top_p=None, top_k=None)
            out.append(tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def _assert_batching_changes_nothing(model_dir: Path, max_new_tokens: int, batch_sizes: tuple) -> list[str]:
    model, tok, stop = load_hf(model_dir)
    want = one_at_a_time(model, tok, stop, ROWS, max_new_tokens)
    for batch_size in batch_sizes:
        got = hf_generate(model, tok, stop, ROWS, max_new_tokens, batch_size=batch_size)
        assert got == want, (batch_size, [(i, w, g) for i, (w, g) in enumerate(zip(want, got)) if w != g])
    return want


def test_batched_answers_equal_one_at_a_time_tiny(tiny_model_dir):
    # 1: no padding at all; 3: batches of unequal size, the last one short; all in one batch
    _assert_batching_changes_nothing(tiny_model_dir, max_new_tokens=16, batch_sizes=(1, 3, len(ROWS)))


@pytest.mark.integration
@pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").exists(), reason=f"{SMOLLM2} not fetched (make setup)")
def test_batched_answers_equal_one_at_a_time_smollm2():
    """A trained model: answers stop at <|im_end|> at different lengths, so finished rows sit padded in the batch
    while the others decode."""
    answers = _assert_batching_changes_nothing(SMOLLM2, max_new_tokens=24, batch_sizes=(3, len(ROWS)))
    assert len({len(a) for a in answers}) > 1  # the batch really held answers of different lengths
    assert "Paris" in answers[2]
