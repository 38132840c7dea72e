"""`zerotune eval RECIPE`: what did the fine-tune do? Every `eval.sets` set scored for the base model, the
fine-tuned HF model (runs/<r>/model) and its GGUF, side by side, with the same chat template and greedy
decoding (check.py's generation helpers), then lm-evaluation-harness tasks when `eval.lm_eval_tasks` names any.

Writes runs/<r>/eval/eval.json and eval.png (grouped bars) and prints one table. A missing model or GGUF is
a user error that says which stage makes it. Exits 1 when a set's `max_drop` is exceeded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import manifest as mf
from .config import EvalSetCfg, Recipe, resolve_path
from .errors import MissingInputError, UserError


def eval_dir(r: Recipe) -> Path:
    return r.out / "eval"


def eval_sets(r: Recipe) -> list[EvalSetCfg]:
    """The recipe's sets; without any, data.heldout scored exact (what check scores)."""
    if r.eval.sets:
        return list(r.eval.sets)
    if r.data.heldout:
        return [EvalSetCfg(name="heldout", path=r.data.heldout, scorer="exact",
                           max_new_tokens=r.check.max_new_tokens)]
    return []


def load_rows(es: EvalSetCfg) -> list[dict]:
    path = resolve_path(es.path)
    if path is None or not path.exists():
        raise MissingInputError(f"eval set '{es.name}': {path} not found (eval.sets[].path); it must be a JSONL of "
                                f"{{\"messages\": [...], \"answer\": \"...\"}} rows.")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
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


def _score_all(es: EvalSetCfg, preds: list[str], rows: list[dict]) -> tuple[float, list[float]]:
    from .scorers import score

    per = [score(es.scorer, p, row, es.pattern) for p, row in zip(preds, rows)]
    return sum(per) / len(per), per


def score_models(r: Recipe, sets: list[EvalSetCfg], rows_by_set: dict[str, list[dict]]) -> dict:
    """{set: {model: {"score", "answers", "seconds"}}} for base, fine-tuned HF and GGUF, one model in memory
    at a time."""
    from .check import base_model_for_check, gguf_answers, hf_generate, load_gguf, load_hf
    from .quantize import gguf_path
    from .train import final_model_dir

    models = {"base": base_model_for_check(r), "hf": final_model_dir(r), "gguf": gguf_path(r)}
    if not (models["hf"] / "config.json").exists():
        raise MissingInputError(f"{models['hf']}: no fine-tuned model; run `zerotune train {r.name}` first.")
    if not models["gguf"].exists():
        raise MissingInputError(f"{models['gguf']}: no GGUF; run `zerotune quantize {r.name}` first.")
    res: dict = {es.name: {} for es in sets}
    for which in ("base", "hf"):
        model, tok, stop = load_hf(models[which])
        for es in sets:
            t0 = time.perf_counter()
            preds = hf_generate(model, tok, stop, rows_by_set[es.name], es.max_new_tokens)
            res[es.name][which] = {"answers": preds, "seconds": round(time.perf_counter() - t0, 2)}
        del model
    llm = load_gguf(models["gguf"], n_ctx=min(r.check.n_ctx, 4096), logits_all=False,
                    n_gpu_layers=r.check.n_gpu_layers)
    try:
        for es in sets:
            t0 = time.perf_counter()
            preds, _ = gguf_answers(llm, rows_by_set[es.name], es.max_new_tokens)
            res[es.name]["gguf"] = {"answers": preds, "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        llm.close()  # its __del__ at interpreter exit raises
    for es in sets:
        for which, v in res[es.name].items():
            v["score"], v["per_row"] = _score_all(es, v["answers"], rows_by_set[es.name])
    return {"models": {k: str(v) for k, v in models.items()}, "sets": res}


def evaluate(r: Recipe) -> int:
    sets = eval_sets(r)
    if not sets:
        raise UserError(f"recipe {r.name}: nothing to evaluate; add eval.sets (name, path, scorer) or data.heldout.")
    rows_by_set = {es.name: load_rows(es) for es in sets}
    lm = run_lm_eval(r) if r.eval.lm_eval_tasks else None  # refuses before minutes of generation, not after
    t0 = time.time()
    scored = score_models(r, sets, rows_by_set)
    failures = []
    table = []
    for es in sets:
        s = scored["sets"][es.name]
        line = {"set": es.name, "scorer": es.scorer, "n": len(rows_by_set[es.name]),
                **{m: round(s[m]["score"], 4) for m in ("base", "hf", "gguf")}, "max_drop": es.max_drop,
                "seconds": {m: s[m]["seconds"] for m in ("base", "hf", "gguf")}}
        table.append(line)
        if es.max_drop is not None and line["hf"] < line["base"] - es.max_drop:
            failures.append(f"{es.name}: fine-tuned HF {line['hf']:.3f} is more than {es.max_drop} below the base "
                            f"model's {line['base']:.3f} (eval.sets[{es.name}].max_drop)")
    out = eval_dir(r)
    out.mkdir(parents=True, exist_ok=True)
    examples = {es.name: [{"prompt": row["messages"][-1].get("content"), "reference": row["answer"],
                           **{m: scored["sets"][es.name][m]["answers"][i] for m in ("base", "hf", "gguf")}}
                          for i, row in enumerate(rows_by_set[es.name][:5])] for es in sets}
    result = {"stage": "eval", "recipe": r.name, "models": scored["models"], "table": table, "lm_eval": lm,
              "failures": failures, "elapsed_s": round(time.time() - t0, 1), "examples": examples,
              "per_row": {es.name: {m: scored["sets"][es.name][m]["per_row"] for m in ("base", "hf", "gguf")}
                          for es in sets}}
    mf.write(out / "eval.json", result)
    plot(table, out / "eval.png", r.name)
    print(format_table(table, lm))
    print(f"eval: wrote {out / 'eval.json'} and {out / 'eval.png'} in {result['elapsed_s']:.0f}s")
    for f in failures:
        print(f"eval: FAIL {f}")
    return 1 if failures else 0


def format_table(table: list[dict], lm: dict | None = None) -> str:
    lines = [f"{'set':<14} {'scorer':<11} {'n':>5} {'base':>7} {'HF':>7} {'GGUF':>7}",
             "-" * 56]
    for t in table:
        lines.append(f"{t['set']:<14} {t['scorer']:<11} {t['n']:>5} {t['base']:>7.3f} {t['hf']:>7.3f} "
                     f"{t['gguf']:>7.3f}")
    for task, v in (lm or {}).get("tasks", {}).items():
        lines.append(f"{'lm-eval ' + task:<26} {v.get('n', 0):>5} {'':>7} {v['hf']:>7.3f} {v['gguf']:>7.3f}")
    return "\n".join(lines)


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


def run_lm_eval(r: Recipe) -> dict:
    """lm-evaluation-harness on the HF model and, through zerotune's server, the GGUF. Not wired yet: refuse
    clearly instead of skipping the tasks the recipe asked for."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"eval.lm_eval_tasks={r.eval.lm_eval_tasks}: lm-evaluation-harness is not installed in "
                        f"this environment; set eval.lm_eval_tasks: [] (the held-out sets still run).") from None
    raise UserError("eval.lm_eval_tasks: running lm-evaluation-harness from zerotune is not implemented yet; "
                    "set eval.lm_eval_tasks: [].")
