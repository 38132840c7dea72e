"""`zerotune eval RECIPE`: what did the fine-tune do? Every `eval.sets` set scored for the base model, the
fine-tuned HF model (runs/<r>/model) and its GGUF, side by side, with the same chat template and greedy
decoding (answering.py, through which `zerotune check` answers too: check and eval share cached answers), then
lm-evaluation-harness tasks when `eval.lm_eval_tasks` names any, and held-out preference pairs when `eval.pairs`
names them (preference accuracy of each model, the tuned model's reward accuracy and margin: preference/scoring.py).

Writes runs/<r>/eval/eval.json and eval.png (grouped bars) and prints one table, with each model's leakage per
set (answers in the task's output format, answering.py). A missing model or GGUF is a user error that says which
stage makes it. Exits 1 when a set's `max_drop` or `max_leakage` is exceeded (the gates check enforces too).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import manifest as mf
from .answering import leakage_by_model, load_rows, score_models, set_failures
from .chat_template import hf_end_tokens
from .config import EvalSetCfg, Recipe
from .errors import UserError
from .layout import layout, write_resolved_recipe
from .preference.scoring import describe as describe_pairs
from .preference.scoring import score_pairs
from .serve import build_app


def evaluate(r: Recipe) -> int:
    sets = r.eval_sets()
    if not sets:
        raise UserError(f"recipe {r.name}: nothing to evaluate; add eval.sets (name, path, scorer) or data.heldout.")
    rows_by_set = {es.name: load_rows(es) for es in sets}
    if r.eval.lm_eval_tasks:
        require_lm_eval(r)  # refuse before minutes of generation, not after
    t0 = time.time()
    scored = score_models(r, sets, rows_by_set)
    lm = run_lm_eval(r, sets[0], rows_by_set[sets[0].name]) if r.eval.lm_eval_tasks else None
    pairs = score_pairs(r)  # eval.pairs: preference accuracy before and after, reward accuracy (preference/scoring.py)
    failures = []
    table = []
    for es in sets:
        s = scored["sets"][es.name]
        scores = {m: s[m]["score"] for m in ("base", "hf", "gguf")}
        leakage = leakage_by_model(s)
        line = {"set": es.name, "scorer": es.scorer, "n": len(rows_by_set[es.name]),
                **{m: round(v, 4) for m, v in scores.items()}, "max_drop": es.max_drop,
                "leakage": leakage and {m: round(v, 4) for m, v in leakage.items()},
                "max_leakage": es.max_leakage, "seconds": {m: s[m]["seconds"] for m in ("base", "hf", "gguf")}}
        table.append(line)
        failures += set_failures(es, scores, leakage)
    out = layout(r).eval
    out.mkdir(parents=True, exist_ok=True)
    examples = {es.name: [{"prompt": row["messages"][-1].get("content"), "reference": row["answer"],
                           **{m: scored["sets"][es.name][m]["answers"][i] for m in ("base", "hf", "gguf")}}
                          for i, row in enumerate(rows_by_set[es.name][:5])] for es in sets}
    result = {"stage": "eval", "recipe": r.name, "models": scored["models"], "table": table, "lm_eval": lm,
              "pairs": pairs,
              "failures": failures, "elapsed_s": round(time.time() - t0, 1), "examples": examples,
              "per_row": {es.name: {m: scored["sets"][es.name][m]["per_row"] for m in ("base", "hf", "gguf")}
                          for es in sets}}
    paths = layout(r)
    mf.write(paths.eval_json, result)
    write_resolved_recipe(paths.eval, r)
    plot(table, paths.eval_png, r.name)
    print(format_table(table, lm))
    if pairs:
        print(describe_pairs(pairs))
    print(f"eval: wrote {paths.eval_json} and {paths.eval_png} in {result['elapsed_s']:.0f}s")
    for f in failures:
        print(f"eval: FAIL {f}")
    return 1 if failures else 0


def format_table(table: list[dict], lm: dict | None = None) -> str:
    """Scores, then leakage (the fraction of answers in the task's format; "-" where it is not measured)."""
    lines = [f"{'set':<14} {'scorer':<11} {'n':>5} {'base':>7} {'HF':>7} {'GGUF':>7}   "
             f"{'leak base':>9} {'HF':>6} {'GGUF':>6}",
             "-" * 82]
    for t in table:
        leak = t["leakage"] or {}
        lines.append(f"{t['set']:<14} {t['scorer']:<11} {t['n']:>5} {t['base']:>7.3f} {t['hf']:>7.3f} "
                     f"{t['gguf']:>7.3f}   {_frac(leak.get('base')):>9} {_frac(leak.get('hf')):>6} "
                     f"{_frac(leak.get('gguf')):>6}")
    for task, v in (lm or {}).get("tasks", {}).items():
        lines.append(f"{'lm-eval ' + task:<26} {v.get('n') or 0:>5} {'':>7} {v['hf'] or 0:>7.3f} "
                     f"{v['gguf'] or 0:>7.3f}")
    return "\n".join(lines)


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(table: list[dict], png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(table))
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(table) + 2), 3.5))
    for k, (m, color) in enumerate((("base", "#bbbbbb"), ("hf", "#4477aa"), ("gguf", "#228833"))):
        vals = [t[m] for t in table]
        bars = ax.bar(x + (k - 1) * 0.27, vals, 0.27, label={"hf": "fine-tuned HF", "gguf": "GGUF"}.get(m, m),
                      color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x, [f"{t['set']}\n({t['scorer']})" for t in table])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("score")
    ax.set_title(f"{title}: held-out scores")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)



LOCAL_TASK = "zerotune_heldout"
_TASK_UTILS = """# Written by zerotune eval: the local task scores with zerotune's own scorer, so lm-eval and `zerotune eval`
# agree on what counts as correct.
from zerotune.scorers import score

SCORER, PATTERN = {scorer!r}, {pattern!r}


def process_results(doc, results):
    row = {{"answer": doc["answer"], **({{"pattern": doc["pattern"]}} if doc.get("pattern") else {{}})}}
    return {{"score": score(SCORER, results[0].strip(), row, PATTERN)}}
"""


def require_lm_eval(r: Recipe) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"eval.lm_eval_tasks={r.eval.lm_eval_tasks}: lm-evaluation-harness is not installed; run "
                        f"`make setup` (requirements.lock pins lm_eval), or set eval.lm_eval_tasks: [].") from None


def write_local_task(r: Recipe, es: EvalSetCfg, rows: list[dict], turn_end: str | None, out: Path) -> Path:
    """An lm-eval task from the first eval set: YAML + JSONL + a process_results that calls scorers.score.
    Prompts are single user turns; a system message shared by every row becomes the task's description, which
    lm-eval sends as the system turn under apply_chat_template."""
    systems = set()
    docs = []
    for i, row in enumerate(rows, 1):
        msgs = row["messages"]
        sys_msgs = [m for m in msgs if m.get("role") == "system"]
        rest = [m for m in msgs if m.get("role") != "system"]
        if len(rest) != 1 or rest[0].get("role") != "user" or len(sys_msgs) > 1:
            raise UserError(f"{es.path} row {i}: the lm-eval task '{LOCAL_TASK}' needs one user message (+ at most "
                            f"one system message) per row; this set has multi-turn prompts. Leave '{LOCAL_TASK}' "
                            f"out of eval.lm_eval_tasks or put single-turn prompts first in eval.sets.")
        systems.add(sys_msgs[0]["content"] if sys_msgs else None)
        docs.append({"prompt": rest[0]["content"], "answer": row["answer"],
                     **({"pattern": row["pattern"]} if row.get("pattern") else {})})
    if len(systems) > 1:
        raise UserError(f"{es.path}: rows have different system messages; the lm-eval task '{LOCAL_TASK}' can carry "
                        f"one (its description).")
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "utils.py").write_text(_TASK_UTILS.format(scorer=es.scorer, pattern=es.pattern))
    system = systems.pop()
    gen = {"until": [turn_end] if turn_end else [], "do_sample": False, "max_gen_toks": es.max_new_tokens}
    task = {"task": LOCAL_TASK, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(out / "data.jsonl")}}, "test_split": "test",
            "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
            "generation_kwargs": gen, "num_fewshot": 0,
            "metric_list": [{"metric": "score", "aggregation": "mean", "higher_is_better": True}],
            **({"description": system} if system else {})}
    import yaml
    text = yaml.safe_dump(task, sort_keys=False) + "process_results: !function utils.process_results\n"
    (out / f"{LOCAL_TASK}.yaml").write_text(text)
    return out


def _metrics_of(res: dict) -> dict:
    """{task: {metric: value}} from simple_evaluate's results, numbers only (stderr dropped)."""
    return {task: {k.split(",")[0]: v for k, v in m.items() if isinstance(v, (int, float)) and "stderr" not in k
                   and k != "alias"} for task, m in res["results"].items()}


def run_lm_eval(r: Recipe, es: EvalSetCfg, rows: list[dict]) -> dict:
    """The same lm-eval tasks on the fine-tuned HF model (hf backend) and on the GGUF through zerotune's own
    OpenAI-compatible server (local-chat-completions), both with the chat template applied."""
    import os
    import socket
    import threading

    import uvicorn
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    model_dir = layout(r).model
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    turn_end = hf_end_tokens(tok, model_dir)["turn_end_id"]
    task_dir = write_local_task(r, es, rows, tok.decode([turn_end]) if turn_end is not None else None,
                                layout(r).eval / "lm_eval_task")
    tm = TaskManager(include_path=str(task_dir))
    common = {"tasks": list(r.eval.lm_eval_tasks), "task_manager": tm, "limit": r.eval.lm_eval_limit,
              "apply_chat_template": True, "log_samples": False, "bootstrap_iters": 0, "batch_size": 1}
    out: dict = {"tasks": {}, "task_dir": str(task_dir)}
    t0 = time.perf_counter()
    hf = simple_evaluate(model="hf", model_args={"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"},
                         **common)
    out["hf_seconds"] = round(time.perf_counter() - t0, 1)

    app, settings = build_app(r)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    old_key = os.environ.get("OPENAI_API_KEY")
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"zerotune's server did not start on 127.0.0.1:{port}")
            time.sleep(0.1)
        if settings.api_key:
            os.environ["OPENAI_API_KEY"] = settings.api_key  # lm-eval's client reads it from there
        t0 = time.perf_counter()
        gg = simple_evaluate(model="local-chat-completions",
                             model_args={"model": r.name, "base_url": f"http://127.0.0.1:{port}/v1/chat/completions",
                                         "num_concurrent": 1, "max_retries": 1, "tokenized_requests": False},
                             **common)
        out["gguf_seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        if old_key is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = old_key
    hm, gm = _metrics_of(hf), _metrics_of(gg)
    for task in hm:
        metric = "score" if "score" in hm[task] else next(iter(hm[task]), None)
        out["tasks"][task] = {"metric": metric, "hf": hm[task].get(metric), "gguf": gm.get(task, {}).get(metric),
                              "n": hf.get("n-samples", {}).get(task, {}).get("effective"),
                              "all_hf": hm[task], "all_gguf": gm.get(task, {})}
    return out
