"""The router's measure of how long one request to a model takes, for weighing costs in units of load.

Little's law over the requests this router forwards: mean duration = time-averaged requests in flight /
completion rate, both decayed with a half-life so the figure follows the traffic. It needs no pairing of
starts with ends (streams end long after they start), and it measures what a client waits, queueing in
the replica included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

HALF_LIFE = 30.0  # seconds
MIN_COMPLETIONS = 2.0  # below this (decayed) count the mean is not trusted: 0, "not measured"


@dataclass(slots=True)
class _Meter:
    inflight: int = 0
    area: float = 0.0  # decayed integral of requests in flight over time
    completions: float = 0.0  # decayed count
    at: float = 0.0


class RequestTimes:
    def __init__(self) -> None:
        self._meters: dict[str, _Meter] = {}

    def started(self, model: str, now: float | None = None) -> None:
        self._advance(model, now).inflight += 1

    def done(self, model: str, now: float | None = None) -> None:
        meter = self._advance(model, now)
        meter.inflight = max(0, meter.inflight - 1)
        meter.completions += 1

    def mean_seconds(self, model: str, now: float | None = None) -> float:
        meter = self._meters.get(model)
        if meter is None:
            return 0.0
        meter = self._advance(model, now)
        return meter.area / meter.completions if meter.completions >= MIN_COMPLETIONS else 0.0

    def _advance(self, model: str, now: float | None) -> _Meter:
        now = time.monotonic() if now is None else now
        meter = self._meters.get(model)
        if meter is None:
            meter = self._meters[model] = _Meter(at=now)
        dt = max(0.0, now - meter.at)
        decay = 0.5 ** (dt / HALF_LIFE)
        meter.area = meter.area * decay + meter.inflight * dt
        meter.completions *= decay
        meter.at = now
        return meter
