"""Answering held-out prompts, for every stage that needs answers: `zerotune check` and `zerotune eval`, the
base model's replay answers (data/replay.py) and the samples during training (train/validation.py).

What is answered: the recipe's eval sets (Recipe.eval_sets, load_rows). Who answers: the base model, the fine-tuned
HF model and its GGUF, each greedily through the same chat template (score_models), one model in memory at a
time, with answers cached so check and eval on the same weights generate once. The HF models answer in
left-padded batches (hf_generate); the GGUF answers through its own embedded template (gguf_answers), as
`zerotune serve` does.

The first set is the task set, the one the recipe trains for. In every other set, an answer given in the task's
output format (JSON for a json_valid / json_fields task, or the set's `forbid` regex) is leakage: it is counted
per model and never scores (_score_all), and set_failures gates it (`max_leakage`) next to `max_drop`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from . import manifest as mf
from . import quiet
from .chat_template import CHAT_FORMAT, stop_ids
from .config import EvalSetCfg, Recipe, resolve_path
from .errors import MissingInputError, UserError, why_unreadable
from .families import answer_text, base_template_kwargs, of_config
from .hub import local_folder
from .layout import layout
from .scorers import leak_test, score


def load_rows(es: EvalSetCfg) -> list[dict]:
    path = resolve_path(es.path)
    if path is None or not path.exists():
        raise MissingInputError(f"eval set '{es.name}': {path} not found (its path in eval.sets, or data.heldout); it must be a JSONL of "
                                f"{{\"messages\": [...], \"answer\": \"...\"}} rows.")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"eval set '{es.name}': {path} cannot be read ({why_unreadable(e)}); it "
                        f"must be a UTF-8 JSONL file of {{\"messages\": [...], \"answer\": \"...\"}} rows.") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {i}: not valid JSON ({e.msg}); eval set '{es.name}'.") from None
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or "answer" not in row:
            raise UserError(f"{path} line {i}: needs 'messages' (the chat prompt, a list) and 'answer' (the "
                            f"reference); eval set '{es.name}'.")
        if es.scorer == "regex" and not (row.get("pattern") or es.pattern):
            raise UserError(f"{path} line {i}: scorer regex needs a pattern: set eval.sets[{es.name}].pattern "
                            f"or a per-row 'pattern' (group 1 = the answer).")
        rows.append(row)
        if es.limit is not None and len(rows) >= es.limit:
            break
    if not rows:
        raise UserError(f"{path}: no rows; eval set '{es.name}' needs at least one prompt.")
    return rows


def leak_tests(sets: list[EvalSetCfg]) -> dict[str, Callable[[str], bool] | None]:
    """{set: what counts as a leaked answer there, or None (not measured)}. The first set is the task: its
    scorer's output format (scorers.FORMATS) is what must not show up in the other sets' answers, unless a set
    says itself what must not (`forbid`). A gate or regex that could measure nothing is refused, not ignored."""
    task = sets[0]
    for k in ("forbid", "max_leakage"):
        if getattr(task, k) is not None:
            raise UserError(f"eval.sets[{task.name}].{k}: the first set is the task set, whose answers are meant to "
                            f"be in its format; leakage is measured on the sets after it. Move {k} to one of those.")
    tests: dict[str, Callable[[str], bool] | None] = {task.name: None}
    for es in sets[1:]:
        tests[es.name] = leak_test(task.scorer, es.forbid)
        if tests[es.name] is None and es.max_leakage is not None:
            raise UserError(f"eval.sets[{es.name}].max_leakage: nothing to measure: the task set '{task.name}' is "
                            f"scored {task.scorer}, which asks for no output format; set eval.sets[{es.name}].forbid "
                            f"(a regex a leaked answer matches, e.g. '^\\s*\\{{') or drop max_leakage.")
    return tests


def score_models(r: Recipe, sets: list[EvalSetCfg], rows_by_set: dict[str, list[dict]]) -> dict:
    """{set: {model: {"score", "per_row", "leakage", "answers", "seconds"}}} for base, fine-tuned HF and GGUF, one
    model in memory at a time; `sets` is every eval set, the task set first. Answers are cached in
    runs/<r>/eval/answers.json by (weights, prompts, max_new_tokens), so `check` and `eval` on the same models
    generate once (greedy decoding: the same inputs give the same text; the HF batch size is not in the key
    because batched answers equal one-at-a-time answers: fp32 on the CPU, where these models answer, tested; in
    fp16 on a GPU a padded row can differ in its last bits). Only answers are cached: scores and leakage are
    computed from them on every call, so a changed scorer, `forbid` or leak rule needs no new answers."""
    leaks = leak_tests(sets)  # a bad leakage setting is refused before minutes of generation
    models = {"base": layout(r).base, "hf": layout(r).model, "gguf": layout(r).gguf}
    if not (models["hf"] / "config.json").exists():
        raise MissingInputError(f"{models['hf']}: no fine-tuned model; run `make finetune RECIPE={r.name}` first.")
    if not models["gguf"].exists():
        raise MissingInputError(f"{models['gguf']}: no GGUF; run `make quantize RECIPE={r.name}` first.")

    family = of_config(Path(models["hf"]))  # its quirks: Qwen3's answers open with a (here empty) thinking block
    # how each model's prompts are rendered: the base model as its makers use it off-task (Qwen3 without
    # thinking), the fine-tuned HF model and the GGUF as trained and served (the template as shipped)
    kwargs = {"base": base_template_kwargs(family), "hf": {}, "gguf": {}}
    cache_file = layout(r).answers
    cache = mf.read(cache_file) or {}
    keys = {(which, es.name): hashlib.sha256(json.dumps([which, weights_identity(Path(models[which])), rows_by_set[es.name],
                                                         es.max_new_tokens] + ([kwargs[which]] if kwargs[which]
                                                                               else [])).encode()).hexdigest()[:16]
            for which in models for es in sets}
    res: dict = {es.name: {} for es in sets}
    for which in models:
        todo = [es for es in sets if keys[which, es.name] not in cache]
        for es in sets:
            if es not in todo:
                res[es.name][which] = dict(cache[keys[which, es.name]], cached=True)
        if not todo:
            continue
        if which == "gguf":
            # a held-out prompt is at most a training row long; the answer comes on top
            llm = load_gguf(models["gguf"], n_ctx=r.data.seq_len + max(es.max_new_tokens for es in todo),
                            logits_all=False, n_gpu_layers=r.check.n_gpu_layers)
            try:
                for es in todo:
                    t0 = _started(which, es, rows_by_set)
                    preds, finish = gguf_answers(llm, rows_by_set[es.name], es.max_new_tokens)
                    res[es.name][which] = {"answers": preds, "finish": finish,
                                           "seconds": round(time.perf_counter() - t0, 2)}
                    _done(res[es.name][which])
            finally:
                llm.close()  # its __del__ at interpreter exit raises
        else:
            model, tok, stop = load_hf(models[which])
            for es in todo:
                t0 = _started(which, es, rows_by_set)
                preds = hf_generate(model, tok, stop, rows_by_set[es.name], es.max_new_tokens, r.eval.batch_size,
                                    kwargs[which])
                res[es.name][which] = {"answers": preds, "seconds": round(time.perf_counter() - t0, 2)}
                _done(res[es.name][which])
            del model
        for es in todo:
            cache[keys[which, es.name]] = res[es.name][which]
        mf.write(cache_file, cache)
    for es in sets:
        for which, v in res[es.name].items():
            answers = [answer_text(family, a) for a in v["answers"]]  # cached raw; scored as a client reads them
            v["score"], v["per_row"], v["leakage"] = _score_all(es, answers, rows_by_set[es.name], leaks[es.name])
    return {"models": {k: str(v) for k, v in models.items()}, "sets": res}


def weights_identity(path: Path) -> str:
    """Which weights these are, cheaply: name, size and mtime of the weight files (a retrained or requantized
    model changes them). A hub id is read in its cached snapshot (a new revision changes them too)."""
    path = path if path.exists() else Path(local_folder(str(path)))
    files = [path] if path.is_file() else sorted([*path.glob("*.safetensors"), path / "config.json"])
    return json.dumps([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()])


def _started(which: str, es: EvalSetCfg, rows_by_set: dict) -> float:
    """Minutes of greedy answers on CPU: say what is being answered, so a log never sits silent."""
    print(f"eval: {which} model answering {len(rows_by_set[es.name])} '{es.name}' prompts "
          f"(up to {es.max_new_tokens} new tokens each) ...", end="", flush=True)
    return time.perf_counter()


def _done(v: dict) -> None:
    print(f" {v['seconds']:.0f}s", flush=True)


def load_hf(model_dir: Path, tokenizer: Path | str | None = None, device: str = "cpu", dtype=None):
    """(model, tokenizer, stop ids) for greedy chat answers: generation stops where the chat template ends an
    assistant turn (<|eot_id|> for Llama 3, <|im_end|> for ChatML) and at every HF end token. `tokenizer`: the
    one whose chat template the answers are for (default: the model folder's); `dtype` default fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer or model_dir))
    # straight onto the device: an 8B model would otherwise sit in host RAM (16 GB in fp16) before moving
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32, device_map=device)
    model.eval()
    return model, tok, stop_ids(tok, model_dir)


def hf_generate(model, tok, stop: list[int], rows: list[dict], max_new_tokens: int, batch_size: int = 8,
                template_kwargs: dict | None = None, device=None, synced_gpus: bool = False) -> list[str]:
    """Greedy chat answers (hf_answers without the finish flags)."""
    return [text for text, _ in hf_answers(model, tok, stop, rows, max_new_tokens, batch_size,
                                           template_kwargs=template_kwargs, device=device, synced_gpus=synced_gpus)]


def hf_answers(model, tok, stop: list[int], rows: list[dict], max_new_tokens: int, batch_size: int = 8,
               progress: str | None = None, template_kwargs: dict | None = None, device=None,
               synced_gpus: bool = False) -> list[tuple[str, bool]]:
    """(answer, finished) per row: greedy chat answers, `batch_size` prompts per generate() call (one decode step
    then serves them all: on 2 CPU cores 8 prompts cost little more than one); finished = it ended with a stop
    token, not at max_new_tokens. Each prompt is tokenized alone, exactly as a batch of one would be, then
    left-padded, so every row's last prompt token sits at the same column and the new tokens line up.
    generate() derives position ids from the attention mask (cumsum - 1), so a padded row sees the positions it
    would see alone. Prompts are grouped longest first, so a batch pads little. `progress`: a bar's label;
    `template_kwargs`: passed to the chat template (families.base_template_kwargs); `device`: where the inputs go
    (default the model's). Under ZeRO-3 (the samples during training) every rank calls this with the same rows
    and batch size, hence makes the same generate() calls, and passes synced_gpus=True: a rank whose answers
    ended keeps joining the parameter gathers of the others. use_cache=True: a training model's config has it off
    (packed rows), and greedy answers are the same with or without a KV cache."""
    import torch
    from tqdm import tqdm

    prompts = [list(tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True, **(template_kwargs or {}))["input_ids"])
               for row in rows]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # Llama 3 ships without one
    pad = stop[0] if pad is None else pad
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[tuple[str, bool]] = [("", False)] * len(prompts)
    device = device or getattr(model, "device", "cpu")
    with torch.no_grad(), tqdm(total=len(prompts), desc=progress, unit="prompt", mininterval=5,
                               disable=None if progress else True) as bar:
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device=device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=stop, pad_token_id=stop[0], temperature=None, top_p=None, top_k=None,
                                 use_cache=True, synced_gpus=synced_gpus)
            for i, new in zip(idx, gen[:, width:].tolist()):
                # a row that stopped early is filled with pad_token_id (a stop id) while the others go on
                end = next((k + 1 for k, t in enumerate(new) if t in stop), None)
                if len(new) > 1 and not any(new[:end]) and len(prompts[i]) < width:
                    # NaN logits make greedy decoding pick token 0 every time: reported upstream for left-padded
                    # rows on some SDPA backends (unsloth #9848, B200); V100/T4's memory-efficient kernel is safe.
                    # An unpadded row's answer is the model's own, whatever it is
                    raise RuntimeError(f"prompt {i}: generate() returned only token 0 (NaN logits?) in a batch of "
                                       f"{len(idx)} left-padded prompts; rerun with eval.batch_size=1")
                out[i] = (tok.decode(new[:end], skip_special_tokens=True).strip(), end is not None)
            bar.update(len(idx))
    return out


def load_gguf(gguf: Path, n_ctx: int, logits_all: bool = True, n_gpu_layers: int = 0):
    """The GGUF as check uses it: every position's logits, the embedded chat template (as serve uses it)."""
    import llama_cpp

    # Gemma 3's sliding-window layers: llama.cpp announces that it keeps a full-size KV cache for them (the
    # default, swa_full; exact for every prompt length), once per load: a note, not a problem
    quiet.drop_llama_cpp_log(b"using full-size SWA cache")
    return llama_cpp.Llama(str(gguf), n_ctx=n_ctx, logits_all=logits_all, seed=0, chat_format=CHAT_FORMAT,
                           n_gpu_layers=n_gpu_layers, verbose=False)


def gpu_offload() -> bool:
    """Whether this llama-cpp-python build runs layers on a GPU (a CUDA build: slurm/check_t4.sbatch's)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def gguf_answers(llm, rows: list[dict], max_new_tokens: int) -> tuple[list[str], list[str]]:
    """Greedy chat answers through the GGUF's embedded template, stopping at its end-of-generation tokens."""
    answers, reasons = [], []
    for row in rows:
        res = llm.create_chat_completion(messages=row["messages"], temperature=0.0, top_k=1,
                                         max_tokens=max_new_tokens, seed=0)
        answers.append((res["choices"][0]["message"]["content"] or "").strip())
        reasons.append(res["choices"][0]["finish_reason"])
    return answers, reasons


def _score_all(es: EvalSetCfg, preds: list[str], rows: list[dict],
               leaks: Callable[[str], bool] | None = None) -> tuple[float, list[float], float | None]:
    """(mean score, per-row scores, leakage: the fraction of answers in the task's format, None = not measured).
    A leaked answer scores 0 whatever the scorer says: `contains` would accept {"world": 7"} for "7", and a
    model that answers everything in the task's JSON has not kept the skill the set measures."""
    per = [score(es.scorer, p, row, es.pattern) for p, row in zip(preds, rows)]
    if leaks is None:
        return sum(per) / len(per), per, None
    leaked = [leaks(p) for p in preds]
    per = [0.0 if lk else s for s, lk in zip(per, leaked)]
    return sum(per) / len(per), per, sum(leaked) / len(leaked)


def leakage_by_model(by_model: dict) -> dict[str, float] | None:
    """One set's {model: fraction of answers in the task's format} from score_models' {model: {...}}; None where
    it is not measured (the task set, or a task whose scorer asks for no format)."""
    if by_model["hf"]["leakage"] is None:
        return None
    return {m: by_model[m]["leakage"] for m in ("base", "hf", "gguf")}


MODEL_NAMES = {"base": "base", "hf": "fine-tuned HF", "gguf": "GGUF"}


def set_failures(es: EvalSetCfg, scores: dict[str, float], leakage: dict[str, float] | None) -> list[str]:
    """The per-set gates check and eval both enforce, from {model: score} and {model: leakage}: the fine-tuned
    model within `max_drop` of the base (retention), and the fine-tuned HF and GGUF answering at most
    `max_leakage` of the set in the task's format (the base model is reported, not gated: it was not tuned)."""
    out = []
    if es.max_drop is not None and scores["hf"] < scores["base"] - es.max_drop - 1e-9:
        out.append(f"{es.name}: fine-tuned HF {scores['hf']:.3f} is more than {es.max_drop} below the base model's "
                   f"{scores['base']:.3f} (eval.sets[{es.name}].max_drop): the fine-tune cost too much here")
    for m in ("hf", "gguf"):
        if es.max_leakage is not None and leakage is not None and leakage[m] > es.max_leakage + 1e-9:
            out.append(f"{es.name}: {MODEL_NAMES[m]} answers {leakage[m]:.3f} of the set in the task's format, more "
                       f"than {es.max_leakage} (eval.sets[{es.name}].max_leakage): the fine-tune leaks its format")
    return out
