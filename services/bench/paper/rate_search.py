"""The highest rate a serving system sustains, found by search: a bracket, then bisection until it is narrow.

A system's sustained rate lies between the highest rate it was seen to sustain ("passed") and the lowest
rate above that it was seen not to ("failed"); both are runs, nothing is interpolated. The search starts
at a given rate (a guess: the previous system's result) and moves up after a pass or down after a failure,
first by sqrt(2) (a good guess is bracketed at once, narrowly) then by 2 per run, until one of each is
found (or the rate leaves [floor, ceiling]: the bracket then stays open on that side); then it tries the
geometric mean of the two ends until failed / passed <= `width` (1.10: within 10%): two runs from a
sqrt(2) bracket, three from a 2x one.

A ratio of two systems' sustained rates rests on both brackets: it lies in [a.passed / b.failed,
a.failed / b.passed], and is reported as that interval, never as one number.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Bracket:
    passed: float | None = None  # the highest rate sustained (None: not even the floor)
    failed: float | None = None  # the lowest rate above it not sustained (None: sustained up to the ceiling)
    trials: list[tuple[float, bool]] = field(default_factory=list)  # (rate, sustained) in the order run

    @property
    def width(self) -> float | None:
        """failed / passed, or None while the bracket is open."""
        return self.failed / self.passed if self.passed and self.failed else None

    def describe(self) -> str:
        if self.passed is None:
            return f"< {self.failed:.4g} (not sustained even there)"
        if self.failed is None:
            return f">= {self.passed:.4g} (sustained up to the search's ceiling)"
        return f"{self.passed:.4g}-{self.failed:.4g}"

    def as_dict(self) -> dict:
        return {"passed": self.passed, "failed": self.failed,
                "width": None if self.width is None else round(self.width, 4),
                "trials": [{"rate": r, "sustained": ok} for r, ok in self.trials]}


def _sig(x: float) -> float:
    """Four significant digits: rates as printed and as tried are the same number."""
    return float(f"{x:.4g}")


def find_sustained(sustains: Callable[[float], bool], start: float, floor: float, ceiling: float,
                   width: float = 1.10) -> Bracket:
    """The bracket of the highest rate `sustains` holds at (assumed to hold below any rate it holds at)."""
    if not 0 < floor <= start <= ceiling or width <= 1:
        raise ValueError(f"need 0 < floor <= start <= ceiling and width > 1, got {floor}, {start}, {ceiling}, {width}")
    b = Bracket()

    def trial(rate: float) -> bool:
        ok = sustains(rate)
        b.trials.append((rate, ok))
        if ok:
            b.passed = rate if b.passed is None else max(b.passed, rate)
        else:
            b.failed = rate if b.failed is None else min(b.failed, rate)
        return ok

    rate, step = _sig(start), math.sqrt(2)
    while True:
        ok = trial(rate)
        if b.passed is not None and b.failed is not None:
            break
        rate, step = _sig(rate * step if ok else rate / step), 2.0
        if rate > ceiling or rate < floor:
            return b
    while b.failed / b.passed > width:
        mid = _sig(math.sqrt(b.passed * b.failed))
        if mid in (b.passed, b.failed):  # four digits cannot split it further
            break
        trial(mid)
    return b


def ratio_bracket(a: Bracket, b: Bracket) -> dict:
    """a's sustained rate over b's, as the interval the two brackets allow: {"low", "high"}; low is 0 and
    high None where a bracket open on the side it needs leaves the ratio unbounded that way."""
    low = a.passed / b.failed if a.passed and b.failed else 0.0
    high = a.failed / b.passed if a.failed and b.passed else None
    return {"low": round(low, 3), "high": None if high is None else round(high, 3)}


def describe_ratio(r: dict) -> str:
    low, high = r["low"], r["high"]
    if not low and high is None:
        return "unbounded (both brackets open)"
    if high is None:
        return f"> {low:.2f}x"
    if not low:
        return f"< {high:.2f}x"
    return f"{low:.2f}-{high:.2f}x"


def trace_requests(rate: float, seconds: float, min_requests: int) -> int:
    """Requests of a trace `seconds` long at `rate` (at least `min_requests`: then it runs longer)."""
    return max(min_requests, math.ceil(rate * seconds))
