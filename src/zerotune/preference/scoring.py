"""Held-out preference pairs after training (`eval.pairs`), for `zerotune eval` and `zerotune check`.

Each model scores each pair's completions by their log-probability (the sum over the completion's label tokens, as
training sums them; the same rendering, labels and token ids as training, data/tokenize.py):

    preference accuracy   the fraction of pairs whose chosen completion the model finds likelier than the rejected
                          one: for the starting model (`base`, model.name_or_path: the reference), the tuned HF model
                          and its GGUF (the same token ids fed to llama.cpp, every position's logits)
    reward accuracy       DPO's own measure (TRL's rewards/accuracies): the fraction of pairs where the tuned model's
                          reward of the chosen completion, beta x (log pi - log pi_base), exceeds the rejected one's
    reward margin         the mean of that difference

The HF models run one at a time through the training code's log-probs (preference/loss.py sequence_logps: no
sequence x vocabulary logits). Results are cached in runs/<r>/eval/pairs.json by the weights' identity, the pairs
and beta, so check reuses what eval computed.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .. import manifest as mf
from ..answering import load_gguf, load_hf, weights_identity
from ..config import Recipe
from ..data.cache import load_tokenizer
from ..data.formats import read_row
from ..data.sources import read_source
from ..data.tokenize import ChatRenderer, encode_batch
from ..errors import BadSample, MissingInputError, UserError
from ..layout import layout

MODELS = ("base", "hf", "gguf")


def load_pairs(r: Recipe, tok) -> list[tuple]:
    """eval.pairs as ((chosen ids, labels), (rejected ids, labels)) per pair, rendered as training renders them."""
    src = r.eval.pairs
    render = ChatRenderer(tok, r.model.tokenizer)
    out = []
    for row in read_source(src, 0):
        try:
            if row.error is not None:
                raise row.error
            doc = read_row(row.data, src.format, src.columns, row.where, src.roles, src.tools)
            (res,) = encode_batch(tok, render, [(row.where, doc.conv, r.data.loss_on, doc.tools)])
            if isinstance(res, BadSample):
                raise res
        except BadSample as e:
            raise UserError(f"eval.pairs: {e}") from None
        out.append(res)
    if not out:
        raise UserError(f"eval.pairs: {src.path} holds no pairs; point it at a JSONL of held-out pairs.")
    return out


def _hf_logps(model_dir: Path, pairs: list[tuple]) -> list[tuple[float, float]]:
    import torch

    from .loss import pair_forward

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok, _ = load_hf(model_dir, device=device, dtype=None if device == "cpu" else torch.float16)
    out = []
    with torch.no_grad():
        for (c_ids, c_lab), (r_ids, r_lab) in pairs:
            n = max(len(c_ids), len(r_ids))
            ids = torch.full((2, n), tok.pad_token_id or 0, dtype=torch.long)
            labels = torch.full((2, n), -100, dtype=torch.long)
            for k, (i, lab) in enumerate(((c_ids, c_lab), (r_ids, r_lab))):
                ids[k, :len(i)], labels[k, :len(i)] = torch.as_tensor(i), torch.as_tensor(lab)
            pos = torch.arange(n).repeat(2, 1)  # right-padded rows, no mask: as training forwards them (collate)
            lp = pair_forward(model, ids.to(device), pos.to(device), labels.to(device))["logps"]
            out.append((float(lp[0]), float(lp[1])))
    del model
    return out


def _gguf_logps(gguf: Path, pairs: list[tuple], n_gpu_layers: int) -> list[tuple[float, float]]:
    import numpy as np

    longest = max(max(len(c[0]), len(r[0])) for c, r in pairs)
    llm = load_gguf(gguf, n_ctx=longest + 8, logits_all=True, n_gpu_layers=n_gpu_layers)
    out = []
    try:
        for pair in pairs:
            lps = []
            for ids, labels in pair:
                llm.reset()
                llm.eval([int(t) for t in ids])
                z = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
                z -= z.max(-1, keepdims=True)
                logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
                nxt = np.asarray(labels[1:])
                at = np.flatnonzero(nxt != -100)
                lps.append(float(logp[at, nxt[at]].sum()))
            out.append(tuple(lps))
    finally:
        llm.close()  # its __del__ at interpreter exit raises
    return out


def _summary(lp: dict, beta: float) -> dict:
    """Accuracies per model; the tuned models' reward accuracy and margin over the starting model."""
    res = {m: {"accuracy": sum(c > r for c, r in v) / len(v)} for m, v in lp.items()}
    for m in ("hf", "gguf"):
        if m in lp and "base" in lp:
            d = [beta * ((c - bc) - (r - br)) for (c, r), (bc, br) in zip(lp[m], lp["base"])]
            res[m]["reward_accuracy"] = sum(x > 0 for x in d) / len(d)
            res[m]["reward_margin"] = sum(d) / len(d)
    return res


def score_pairs(r: Recipe) -> dict | None:
    """eval.pairs scored for the starting model, the tuned HF model and the GGUF (module docstring); None without
    eval.pairs."""
    if r.eval.pairs is None:
        return None

    paths = layout(r)
    models = {"base": paths.base, "hf": paths.model, "gguf": paths.gguf}
    for which, what in (("hf", "finetune"), ("gguf", "quantize")):
        if not Path(models[which]).exists():
            raise MissingInputError(f"{models[which]} not found. Run `make {what} RECIPE={r.name}` first.")
    pairs = load_pairs(r, load_tokenizer(r))
    digest = hashlib.sha256(json.dumps([[list(map(int, c[0])), list(map(int, c[1])), list(map(int, x[0])),
                                         list(map(int, x[1]))] for c, x in pairs]).encode()).hexdigest()[:16]
    cache = mf.read(paths.eval / "pairs.json") or {}
    lp, seconds = {}, {}
    for which in MODELS:
        key = hashlib.sha256(json.dumps([which, str(models[which]), weights_identity(Path(models[which])),
                                         digest]).encode()).hexdigest()[:16]
        if key in cache:
            lp[which], seconds[which] = [tuple(x) for x in cache[key]["logps"]], cache[key]["seconds"]
            continue
        print(f"{which}: log-probs of {len(pairs)} held-out pairs ({r.eval.pairs.path})", flush=True)
        t0 = time.perf_counter()
        lp[which] = (_gguf_logps(models[which], pairs, r.check.n_gpu_layers) if which == "gguf"
                     else _hf_logps(Path(models[which]), pairs))
        seconds[which] = round(time.perf_counter() - t0, 2)
        cache[key] = {"logps": lp[which], "seconds": seconds[which]}
        paths.eval.mkdir(parents=True, exist_ok=True)
        mf.write(paths.eval / "pairs.json", cache)
    return {"path": r.eval.pairs.path, "n": len(pairs), "beta": r.preference.beta, **_summary(lp, r.preference.beta),
            "seconds": seconds}


def describe(p: dict) -> str:
    """One line per measure, as eval and check print them."""
    return (f"  pairs ({p['n']}, {p['path']}): preference accuracy base {p['base']['accuracy']:.3f} | HF "
            f"{p['hf']['accuracy']:.3f} | GGUF {p['gguf']['accuracy']:.3f}; reward accuracy over base HF "
            f"{p['hf']['reward_accuracy']:.3f} | GGUF {p['gguf']['reward_accuracy']:.3f}, margin HF "
            f"{p['hf']['reward_margin']:.4f} | GGUF {p['gguf']['reward_margin']:.4f} (beta {p['beta']})")
