"""The memory breakdown, measured on the scheduler with the shadow engine: reservations show as reserved
and internal fragmentation, scattered free space as external fragmentation, paged blocks as neither;
and the sustained-rate arithmetic."""

from __future__ import annotations

import math

import pytest

from services.bench.paper.kv_breakdown import BusiestMoment
from services.bench.paper.serve import serve_trace
from services.bench.paper.workloads import TraceRequest
from tests.scheduler.test_scheduler import make_core


def _trace(lengths: list[tuple[int, int]]) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.0, [50 + i] * n_in, n_out) for i, (n_in, n_out) in enumerate(lengths)]


def _breakdown(tokenizer, system, lengths, num_blocks=48, max_model_len=64):
    core, _ = make_core(tokenizer, num_blocks=num_blocks, block_size=4, budget=256, max_seqs=64, system=system,
                        max_model_len=max_model_len)
    busiest = BusiestMoment()
    res = serve_trace(core, _trace(lengths), math.inf, on_step=busiest.observe)
    assert res.normalized_latency > 0 and core.pool.num_in_use == 0
    return busiest.result()


def test_paged_blocks_waste_only_the_end_of_the_last_block(smol_tokenizer):
    b = _breakdown(smol_tokenizer, "pagedserve", [(6, 10)] * 6)
    assert b.external_fragmentation == 0 and b.running == 6
    # 6 sequences of at most 15 written tokens in 4-slot blocks: under one block each is never written.
    assert 0 <= b.internal_fragmentation < 6 * 4 * 100 / (48 * 4)
    assert b.token_states > 3 * (b.reserved + b.internal_fragmentation)


def test_max_reservations_are_mostly_internal_fragmentation(smol_tokenizer):
    b = _breakdown(smol_tokenizer, "orca-max", [(6, 10)] * 6)
    # 64-token reservations for 15 written tokens: 3 fit in 48 blocks, and most of each is never used.
    assert b.running == 3
    assert b.internal_fragmentation > 2 * (b.token_states + b.reserved)
    oracle = _breakdown(smol_tokenizer, "orca-oracle", [(6, 10)] * 6)
    assert oracle.internal_fragmentation < b.internal_fragmentation
    assert oracle.token_states + oracle.reserved > b.token_states + b.reserved


def test_free_space_between_reservations_counts_as_external_fragmentation(smol_tokenizer):
    # Short requests interleaved with long ones: when the short ones leave, their holes are too small for
    # the next long reservation while it waits.
    lengths = [(4, 4), (4, 40), (4, 4), (4, 40), (4, 4), (4, 40), (40, 20)]
    b = _breakdown(smol_tokenizer, "orca-oracle", lengths, num_blocks=40)
    assert b.external_fragmentation > 0
    total = b.token_states + b.reserved + b.internal_fragmentation + b.external_fragmentation + b.free
    assert total == pytest.approx(100.0)
