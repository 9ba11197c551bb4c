"""The paper's workloads: log-normal lengths with the stated means, scaled with the max length and pool;
Poisson arrivals at the asked rate, the same requests at every rate."""

from __future__ import annotations

import math
import statistics

import pytest

from services.bench.paper.workloads import (
    ALPACA,
    PAPER_POOL_IN_MAX_SEQS,
    SHAREGPT,
    WorkloadScale,
    poisson_trace,
)


@pytest.mark.parametrize("dist", [SHAREGPT, ALPACA])
def test_lengths_follow_the_papers_means_and_scale_with_the_pool(dist):
    w = WorkloadScale(dist, 1.0)
    trace = poisson_trace(w, 3000, math.inf, 49152, seed=3)
    mean_in = statistics.fmean(len(r.prompt_token_ids) for r in trace)
    mean_out = statistics.fmean(r.output_len for r in trace)
    # Clipping at the max length trims a little of the tail: within 10% of the paper's means.
    assert abs(mean_in / dist.mean_input - 1) < 0.1 and abs(mean_out / dist.mean_output - 1) < 0.1
    assert all(len(r.prompt_token_ids) + r.output_len <= w.max_seq_len and r.output_len >= 1 for r in trace)
    small = WorkloadScale(dist, 0.25)
    assert small.max_seq_len == w.max_seq_len // 4
    assert small.pool_blocks(16) * 16 >= PAPER_POOL_IN_MAX_SEQS * small.max_seq_len > (small.pool_blocks(16) - 1) * 16


def test_poisson_arrivals_at_the_rate_with_the_same_requests_at_every_rate():
    w = WorkloadScale(SHAREGPT, 0.125)
    slow, fast = (poisson_trace(w, 2000, rate, 49152, seed=5) for rate in (2.0, 8.0))
    gaps = [b.arrival - a.arrival for a, b in zip(fast, fast[1:], strict=False)]
    assert abs(statistics.fmean(gaps) - 1 / 8) < 0.01
    assert abs(statistics.pstdev(gaps) / statistics.fmean(gaps) - 1) < 0.1  # exponential: cv 1
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert [r.output_len for r in slow] == [r.output_len for r in fast]
    assert all(r.arrival == 0 for r in poisson_trace(w, 10, math.inf, 49152, seed=5))
