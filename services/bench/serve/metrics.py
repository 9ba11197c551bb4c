"""Summaries of one serving run: throughput, latency percentiles, goodput under an SLO, errors."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from services.bench.serve.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass
class SLO:
    ttft: float | None = None  # seconds
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """'ttft=500ms,tpot=100ms' (units ms or s; e2e too)."""
        slo = cls()
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, _, value = part.partition("=")
            if name not in ("ttft", "tpot", "e2e") or not value:
                raise ValueError(f"bad SLO term {part!r}: use ttft=, tpot= or e2e= with ms or s")
            seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.removesuffix("s"))
            setattr(slo, name, seconds)
        return slo

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft), (self.tpot, r.tpot), (self.e2e, r.e2e))
        return all(limit is None or (value is not None and value <= limit) for limit, value in checks)

    def __str__(self) -> str:
        terms = [f"{n}={v * 1000:g}ms" for n, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e))
                 if v is not None]
        return ",".join(terms) or "none"


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(values: list[float]) -> dict:
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = statistics.fmean(values) if values else None
    return out


def summarize(results: list[RequestResult], duration: float, slo: SLO) -> dict:
    ok = [r for r in results if r.ok]
    errors = Counter(str(r.status) if r.status not in (None, 200) else (r.error.split(":")[0] or "error")
                     for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_s": _dist([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _dist([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _dist([gap for r in ok for gap in r.itl]),
        "e2e_s": _dist([r.e2e for r in ok]),
        "slo": str(slo),
        "goodput": sum(slo.met(r) for r in results) / duration if duration else 0.0,
        "ttft_samples": sorted(r.ttft for r in ok if r.ttft is not None),
        "tpot_samples": sorted(r.tpot for r in ok if r.tpot is not None),
    }
