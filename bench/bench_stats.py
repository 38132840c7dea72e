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


def timed(fn) -> tuple[object, float, float, float]:
    """(result, wall s, CPU s, of which system s). System time is kept apart: on this VM a small generate() call now
    and then took ~20 s of one thread's CPU time instead of its usual 1-2 s; the split says whether the kernel took
    it (page reclaim with memory short) or the process did."""
    import os
    import time

    w, t = time.perf_counter(), os.times()
    out = fn()
    e = os.times()
    return out, time.perf_counter() - w, (e.user + e.system) - (t.user + t.system), e.system - t.system


def write_results(out, data: dict, md: list[str], indent: int = 2) -> None:
    """A bench's results: OUT.json (the numbers) and OUT.md (the table bench/report.py assembles)."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=indent) + "\n")
    out.with_suffix(".md").write_text("\n".join(md).rstrip("\n") + "\n")
