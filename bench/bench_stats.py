"""Ratio statistics shared by the benchmarks: each ratio is taken within one repeat (both sides measured
back to back, so load drift hits both), then summarised over the alternating repeats."""

from __future__ import annotations

import statistics


def ratio_stats(per_repeat: list[float]) -> dict:
    """{'per_repeat', 'median', 'spread'}; spread = (max - min) / median of the per-repeat ratios."""
    med = statistics.median(per_repeat)
    return {"per_repeat": [round(x, 3) for x in per_repeat], "median": round(med, 3),
            "spread": round((max(per_repeat) - min(per_repeat)) / med, 3)}


def fmt_ratio(s: dict) -> str:
    """'3.05x (3.01-3.12x over 3 repeats, spread 3.4%)'."""
    lo, hi = min(s["per_repeat"]), max(s["per_repeat"])
    return f"{s['median']:.2f}x ({lo:.2f}-{hi:.2f}x over {len(s['per_repeat'])} repeats, spread {s['spread']:.1%})"
