"""Ratio statistics shared by the benchmarks: each ratio is taken within one repeat (both sides measured
back to back, so load drift hits both), then summarised over the alternating repeats."""

from __future__ import annotations

import statistics


def ratio_stats(per_repeat: list[float]) -> dict:
    """{'per_repeat', 'median', 'spread'}; spread = (max - min) / median of the per-repeat ratios."""
    med = statistics.median(per_repeat)
    return {"per_repeat": [round(x, 3) for x in per_repeat], "median": round(med, 3),
            "spread": round((max(per_repeat) - min(per_repeat)) / med, 3)}


def fmt_ratio(s: dict, unit: str = "repeats") -> str:
    """'3.05x (3.01-3.12x over 3 repeats, spread 3.4%)'."""
    lo, hi = min(s["per_repeat"]), max(s["per_repeat"])
    return f"{s['median']:.2f}x ({lo:.2f}-{hi:.2f}x over {len(s['per_repeat'])} {unit}, spread {s['spread']:.1%})"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


class Steal:
    """Share of CPU time the hypervisor gave to other guests ("steal" in /proc/stat) while a benchmark ran.
    This VM's vCPUs are shared: at 8-26% steal (seen during `make bench`) wall-clock timings of identical work
    moved by up to a third, so every result records the steal it was measured under."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return v[7] if len(v) > 7 else 0, sum(v[:8])  # steal, total (user..steal; guest is inside user)

    def fraction(self) -> float | None:
        end = self._read()
        if self.start is None or end is None or end[1] == self.start[1]:
            return None
        return round((end[0] - self.start[0]) / (end[1] - self.start[1]), 3)
