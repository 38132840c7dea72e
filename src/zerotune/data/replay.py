"""Self-distilled replay (`data.replay`): the base model's own answers to general prompts, mixed into training.

Why: a narrow fine-tune moves the model everywhere, not only on its task. Fully fine-tuned on JSON extraction,
SmolLM2 answered general questions in the task's JSON and lost some it used to get right (docs/smollm2_demo.md).
Training beside the base model's own greedy answers to general prompts keeps the fine-tune near the base model
off-task, with no outside data and no teacher ("Self-Distillation Bridges Distribution Gap in Language Model
Fine-Tuning", arXiv 2402.13669, uses the model's own rewrites for the same end).

Phase: the data step (`zerotune data`), one process, before any launch. The recipe's base model answers the
prompts through the training tokenizer's chat template (answering.hf_answers, eval.batch_size per generate()
call): on a CUDA GPU when one is visible, in the precision training would use there (fp16 on V100, bf16 on
sm80+), else on the CPU in fp32. `zerotune plan` says what it costs at the recipe's scale (planner/phases.py,
replay_plan).

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
from ..config import Recipe, SourceCfg, resolve_path
from ..errors import MissingInputError, UserError
from ..layout import layout


FORMAT = 2  # bump when what is kept or how it is written changes (2: cut-off answers kept, marked truncated)


class ReplayError(UserError, ValueError):
    pass


def _prompt_file(r: Recipe) -> Path:
    path = resolve_path(r.data.replay.path)
    if path is None or not path.is_file():
        raise MissingInputError(f"data.replay.path: {path} not found; it must be a JSONL of general prompts, one "
                                f"{{\"messages\": [{{\"role\": \"user\", \"content\": \"...\"}}]}} per line "
                                f"(data/general/prompts.jsonl ships with zerotune).")
    return path


def load_prompts(r: Recipe) -> list[dict]:
    """The replay prompts: chat prompts that end with a user turn, the first data.replay.limit of them."""
    path = _prompt_file(r)
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{r.data.replay.path} line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReplayError(f"{where}: not valid JSON ({e.msg}); each line is one {{\"messages\": [...]}} "
                              f"object.") from None
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user",
                                                                                                 "assistant")
                for m in msgs):
            raise ReplayError(f"{where}: needs 'messages', a list of {{role, content}} turns (system, user, "
                              f"assistant) with string content.")
        if msgs[-1]["role"] != "user":
            raise ReplayError(f"{where}: the last turn is '{msgs[-1]['role']}'; a replay prompt ends with the user "
                              f"turn the base model answers.")
        extra = sorted(set(row) - {"messages"})
        if extra:
            raise ReplayError(f"{where}: unexpected key(s) {extra}: a replay prompt is only 'messages' (the base "
                              f"model writes the answer); remove them.")
        rows.append({"messages": msgs})
        if r.data.replay.limit is not None and len(rows) >= r.data.replay.limit:
            break
    if not rows:
        raise ReplayError(f"{r.data.replay.path}: no prompts; data.replay needs at least one.")
    return rows


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def check_disjoint(r: Recipe, prompts: list[dict]) -> None:
    """Refuse replay prompts that are also evaluation prompts: replaying the base model's answer to a held-out
    question would train on the test (compared on the last user turn, case and punctuation ignored)."""
    from ..answering import eval_sets, load_rows

    mine = {_norm(p["messages"][-1]["content"]): p["messages"][-1]["content"] for p in prompts}
    for es in eval_sets(r):  # data.heldout among them when it is set (config allows one of the two)
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


def _weights_identity(r: Recipe) -> str:
    """Which base weights answer, cheaply: the resolved folder (a hub id's snapshot folder names its commit) and
    the name, size and mtime of its weight files."""
    from ..answering import _identity
    from ..hub import local_folder

    folder = local_folder(str(layout(r).base))
    return json.dumps([str(folder), _identity(Path(folder))])


def _template_kwargs(r: Recipe) -> dict:
    """How the base model is prompted (families.base_template_kwargs: Qwen3 answers without reasoning)."""
    from ..families import base_template_kwargs, of_config
    from ..hub import local_folder

    return base_template_kwargs(of_config(Path(local_folder(str(layout(r).base)))))


def replay_key(r: Recipe, tok) -> dict:
    """What the replay answers depend on (the data fingerprint holds it), and its digest (the cache file name)."""
    rp = r.data.replay
    inputs = {"format": FORMAT, "prompts_sha256": mf.sha256(_prompt_file(r)), "limit": rp.limit, "max_new_tokens": rp.max_new_tokens,
              "chat_template": hashlib.sha256((tok.chat_template or "").encode()).hexdigest(),
              "weights": _weights_identity(r)}
    if _template_kwargs(r):
        inputs["template_kwargs"] = _template_kwargs(r)
    return {"key": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16], "inputs": inputs}


def _device_and_dtype(family):
    """Where training would run: a CUDA GPU in its training precision for this model family (hardware.choose: a
    Gemma 3 on a V100 or T4 answers in fp32, as it trains, never in the fp16 families.py refuses), else the CPU in
    fp32."""
    import torch

    from ..hardware import choose, detect

    gpu = detect()
    if gpu.capability is None:
        return "cpu", torch.float32, "fp32"
    precision = choose(gpu, fa2_installed=False, family=family).precision
    return "cuda", {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision], precision


def answer(r: Recipe, tok, prompts: list[dict], key: dict) -> dict:
    """The base model answers the prompts once; the conversations and their counts go to the cache."""
    from ..answering import hf_answers, load_hf
    from ..hub import local_folder

    from ..families import of_config

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
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    tmp = jsonl.with_name(jsonl.name + ".tmp")
    tmp.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in kept), encoding="utf-8")
    mf.write(jsonl.with_suffix(".json"), meta)  # the counts first: answers without them are not a cache hit
    tmp.replace(jsonl)
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
    info = {**{k: meta[k] for k in ("key", "prompts", "kept", "cut_off", "empty", "device", "precision",
                                    "seconds")},
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
