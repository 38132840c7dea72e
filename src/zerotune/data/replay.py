"""Self-distilled replay (`data.replay`): the base model's own answers to general prompts, mixed into training.

Why: a narrow fine-tune moves the model everywhere, not only on its task. Fully fine-tuned on JSON extraction,
SmolLM2 answered general questions in the task's JSON and lost some it used to get right (docs/smollm2_demo.md).
Training beside the base model's own greedy answers to general prompts keeps the fine-tune near the base model
off-task, with no outside data and no teacher ("Self-Distillation Bridges Distribution Gap in Language Model
Fine-Tuning", arXiv 2402.13669, uses the model's own rewrites for the same end).

Phase: the data step (`zerotune data`), one process, before any launch. The recipe's base model answers the
prompts through the training tokenizer's chat template (answering.hf_answers, eval.batch_size per generate()
call): on a CUDA GPU when one is visible, in the precision training would use there (fp16 on V100, bf16 on
sm80+), else on the CPU in fp32. `zerotune plan` says what it costs at the recipe's scale (planner/replay.py).

Cache: <output_dir>/replay/answers-<key>.jsonl (layout.replay_answers), key = the base weights' identity, the
prompts (sha256 and limit), the chat template and max_new_tokens. The data fingerprint holds the key: changing
seq_len, packing or ratio re-mixes without answering again; other prompts or other weights answer again.

What is kept: every non-empty answer. One cut off at max_new_tokens is trained on its text without the template's
end-of-turn (`"truncated": true`, data/tokenize.py): with its end label it would teach stopping mid-sentence, and
leaving it out would teach answering shorter than the base model (SmolLM2 runs past 128 tokens on 45% of
data/general/prompts.jsonl). Empty answers are left out and counted.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from pathlib import Path

from .. import manifest as mf
from ..answering import hf_answers, load_hf, load_rows, weights_identity
from ..config import Recipe, SourceCfg, resolve_path
from ..errors import MissingInputError
from ..families import base_template_kwargs, of_config
from ..hardware import choose, detect
from ..hub import local_folder
from ..layout import layout
from .replay_prompts import ReplayError, load_prompts, prompt_file

FORMAT = 2  # bump when what is kept or how it is written changes (2: cut-off answers kept, marked truncated)


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def check_disjoint(r: Recipe, prompts: list[dict]) -> None:
    """Refuse replay prompts that are also evaluation prompts: replaying the base model's answer to a held-out
    question would train on the test (compared on the last user turn, case and punctuation ignored)."""
    mine = {_norm(p["messages"][-1]["content"]): p["messages"][-1]["content"] for p in prompts}
    for es in r.eval_sets():  # data.heldout among them when it is set (config allows one of the two)
        try:
            rows = load_rows(es)
        except MissingInputError:
            continue  # not there yet: the stage that scores it says so
        users = [m["content"] for row in rows for m in row["messages"][-1:]
                 if isinstance(m, dict) and isinstance(m.get("content"), str)]
        both = [mine[k] for k in dict.fromkeys(_norm(u) for u in users) if k in mine]
        if both:
            raise ReplayError(f"data.replay.path {r.data.replay.path}: {len(both)} prompt(s) also in eval set "
                              f"'{es.name}' ({es.path}), e.g. {both[0]!r}: replaying the base model's answers to "
                              f"them would train on the test. Fix: remove them from one of the two files.")


def _base_weights(r: Recipe) -> str:
    """Which base weights answer, cheaply: the resolved folder (a hub id's snapshot folder names its commit) and
    the name, size and mtime of its weight files."""
    folder = local_folder(str(layout(r).base))
    return json.dumps([str(folder), weights_identity(Path(folder))])


def _template_kwargs(r: Recipe) -> dict:
    """How the base model is prompted (families.base_template_kwargs: Qwen3 answers without reasoning)."""
    return base_template_kwargs(of_config(Path(local_folder(str(layout(r).base)))))


def replay_key(r: Recipe, tok) -> dict:
    """What the replay answers depend on (the data fingerprint holds it), and its digest (the cache file name)."""
    rp = r.data.replay
    inputs = {"format": FORMAT, "prompts_sha256": mf.sha256(prompt_file(r)), "limit": rp.limit, "max_new_tokens": rp.max_new_tokens,
              "chat_template": hashlib.sha256((tok.chat_template or "").encode()).hexdigest(),
              "weights": _base_weights(r)}
    if _template_kwargs(r):
        inputs["template_kwargs"] = _template_kwargs(r)
    return {"key": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16], "inputs": inputs}


def _device_and_dtype(family):
    """Where training would run: a CUDA GPU in its training precision for this model family (hardware.choose: a
    Gemma 3 on a V100 or T4 answers in fp32, as it trains, never in the fp16 families.py refuses), else the CPU in
    fp32."""
    import torch

    gpu = detect()
    if gpu.capability is None:
        return "cpu", torch.float32, "fp32"
    precision = choose(gpu, fa2_installed=False, family=family).precision
    return "cuda", {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision], precision


def answer(r: Recipe, tok, prompts: list[dict], key: dict) -> dict:
    """The base model answers the prompts once; the conversations and their counts go to the cache."""
    paths = layout(r)
    base = local_folder(str(paths.base))
    device, dtype, precision = _device_and_dtype(of_config(Path(base)))
    rp = r.data.replay
    print(f"data: replay: the base model ({r.model.name_or_path}) answers {len(prompts)} prompts of "
          f"{rp.path} on {device} in {precision}, {r.eval.batch_size} per batch, up to {rp.max_new_tokens} new "
          f"tokens each (once; cached by weights, prompts and template)", flush=True)
    t0 = time.perf_counter()
    # the tokenizer's files where this node has them (a hub id: its snapshot in the cache, no network lookup);
    # only its end tokens are used here, with the model's generation_config (load_hf)
    tok_dir = resolve_path(r.model.tokenizer)
    model, _, stop = load_hf(base, tokenizer=tok_dir if tok_dir.exists() else local_folder(r.model.tokenizer),
                             device=device, dtype=dtype)
    # the training tokenizer renders the prompts: the answers are for the template the conversations train in
    got = hf_answers(model, tok, stop, prompts, rp.max_new_tokens, r.eval.batch_size, progress="data: replay",
                     template_kwargs=_template_kwargs(r))
    del model
    seconds = time.perf_counter() - t0
    # a reply cut off at max_new_tokens is kept for its text, without the end-of-turn label (tokenize.py):
    # leaving long answers out would teach the fine-tune to answer shorter than the base model does
    kept = [{"messages": p["messages"] + [{"role": "assistant", "content": text, **({} if finished else
                                                                                   {"truncated": True})}]}
            for p, (text, finished) in zip(prompts, got) if text]
    meta = {"key": key["key"], "inputs": key["inputs"], "prompts": len(prompts), "kept": len(kept),
            "cut_off": sum(bool(t and not f) for t, f in got), "empty": sum(not t for t, _ in got),
            "device": device, "precision": precision, "batch_size": r.eval.batch_size,
            "seconds": round(seconds, 1)}
    jsonl = paths.replay_answers(key["key"])
    mf.write(jsonl.with_suffix(".json"), meta)  # the counts first: answers without them are not a cache hit
    mf.write_atomic(jsonl, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in kept))
    return meta


def replay_source(r: Recipe, tok, task_rows: int, key: dict) -> tuple[SourceCfg, dict]:
    """The replay conversations as one more data source, weighted so that they make data.replay.ratio of the
    training documents (task_rows: the recipe's own sources' rows after their weights), and what the manifest
    and the log say about them. Answers come from the cache when it holds this key, else from the base model."""
    prompts = load_prompts(r)
    check_disjoint(r, prompts)
    jsonl = layout(r).replay_answers(key["key"])
    meta = mf.read(jsonl.with_suffix(".json"))
    cached = bool(meta and meta.get("key") == key["key"] and jsonl.is_file())
    if not cached:
        meta = answer(r, tok, prompts, key)
    if meta["kept"] == 0:
        raise ReplayError(f"data.replay: the base model answered none of the {meta['prompts']} prompts of "
                          f"{r.data.replay.path} (every answer empty): check that the model and model.tokenizer "
                          f"belong together, or use other prompts.")
    ratio = r.data.replay.ratio
    weight = ratio * task_rows / ((1 - ratio) * meta["kept"])
    taken = int(math.floor(weight)) * meta["kept"] + int(round((weight - math.floor(weight)) * meta["kept"]))
    # the planner sizes the answering from these once they are known (planner/replay.py)
    lengths = [len(tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True, **_template_kwargs(r))["input_ids"]) for p in prompts]
    info = {**{k: meta[k] for k in ("key", "prompts", "kept", "cut_off", "empty", "device", "precision",
                                    "seconds")},
            "prompts_sha256": mf.sha256(prompt_file(r)), "prompt_tokens_max": max(lengths),
            "cached": cached, "answers": str(jsonl), "ratio": ratio, "weight": round(weight, 4),
            "documents": taken, "share": round(taken / max(1, taken + task_rows), 4),
            "times_each": round(weight, 2)}
    # the key leaves out where the answers were made (a CPU rebuild reuses a GPU node's answers): say it
    how = (f"cached, answered on {meta['device']} in {meta['precision']}" if cached else
           f"answered in {meta['seconds']:.0f} s on {meta['device']} in {meta['precision']}")
    left = (f"; {meta['cut_off']} cut off at max_new_tokens={r.data.replay.max_new_tokens} (trained without "
            f"their end of turn)" if meta["cut_off"] else "") + (f"; {meta['empty']} empty left out"
                                                                 if meta["empty"] else "")
    print(f"data: replay: {meta['kept']} of {meta['prompts']} base-model answers kept ({how}){left}; mixed "
          f"{weight:.2f}x = {taken:,} documents beside {task_rows:,} task rows ({info['share']:.1%} of training, "
          f"data.replay.ratio {ratio})", flush=True)
    return SourceCfg(path=str(jsonl), format="messages", weight=weight), info
