"""The router's measured mean request time (Little's law, decayed), which prices an adapter's load."""

from __future__ import annotations

from services.router.request_time import HALF_LIFE, RequestTimes


def test_mean_request_time_follows_littles_law_and_decays():
    times = RequestTimes()
    assert times.mean_seconds("m", now=0.0) == 0.0  # nothing measured
    # Two requests at a time, each 2 s long, one starting every second: mean duration 2 s.
    for t in range(0, 20):
        times.started("m", now=float(t))
        if t >= 2:
            times.done("m", now=float(t))
    assert abs(times.mean_seconds("m", now=19.0) - 2.0) < 0.15
    assert times.mean_seconds("other", now=19.0) == 0.0  # per model
    # Traffic stops: old completions fade, and the figure stops being trusted.
    assert times.mean_seconds("m", now=19.0 + 20 * HALF_LIFE) == 0.0
