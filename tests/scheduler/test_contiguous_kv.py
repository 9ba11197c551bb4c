"""Contiguous reservations: sizes per policy, runs of consecutive blocks, real external fragmentation,
outputs equal to the paged allocator's, and every block back in the pool."""

from __future__ import annotations

import pytest

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.block_pool import BlockPool
from services.scheduler.contiguous_kv import ContiguousKVManager, Reservation, reservation_tokens
from services.scheduler.sequence import Sequence
from tests.scheduler.test_scheduler import greedy, make_core, run_all


@pytest.mark.parametrize("out", [1, 2, 3, 25, 32, 33, 100])
def test_reservation_sizes(out):
    pow2 = reservation_tokens(Reservation.POW2, 10, out, 4096) - 10
    assert pow2 >= out and pow2 & (pow2 - 1) == 0 and pow2 < 2 * out + 1  # the next power of two, no further
    assert reservation_tokens(Reservation.ORACLE, 10, out, 4096) == 10 + out
    assert reservation_tokens(Reservation.MAX, 10, out, 4096) == 4096
    assert reservation_tokens(Reservation.POW2, 10, out, 40) <= 40  # never past the maximum length
    assert reservation_tokens(Reservation.ORACLE, 10, None, 512) == 512  # no length known: the maximum


def _seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens), 0)


def test_free_space_scattered_between_reservations_cannot_place_a_larger_one():
    pool = BlockPool(12, enable_caching=False)
    kv = ContiguousKVManager(pool, 4, Reservation.ORACLE, 4096)
    a, b, c = (_seq(r, 8, 8) for r in "abc")  # 16 tokens: 4 blocks each, filling the arena
    for s in (a, b, c):
        assert kv.allocate_slots(s, 8)
    assert [kv.runs[s.seq_id][0].block_id for s in (a, b, c)] == [0, 4, 8]
    assert kv.block_ids["b"] == [4, 5]  # only the blocks written so far go to the engine
    kv.free(a)
    kv.free(c)
    assert kv.free_runs() == [(0, 4), (8, 4)]
    big = _seq("big", 8, 16)  # 24 tokens: 6 blocks, while 8 are free
    assert pool.num_free == 8 and not kv.allocate_slots(big, 8)
    kv.free(b)
    assert kv.allocate_slots(big, 8) and kv.runs["big"][0].block_id == 0
    ids = [blk.block_id for blk in kv.runs["big"]]
    assert ids == list(range(ids[0], ids[0] + 6))
    kv.free(big)
    assert pool.num_in_use == 0
    pool.check_invariants()


@pytest.mark.parametrize("system", ["orca-max", "orca-pow2", "orca-oracle", "request-level"])
def test_baselines_compute_what_pagedserve_computes_and_return_every_block(tokenizer, system):
    requests = [(f"r{i}", [20 + i] * (3 + 2 * i), 4 + 3 * i) for i in range(8)]
    results = {}
    for name in ("pagedserve", system):
        core, ex = make_core(tokenizer, num_blocks=64, block_size=4, budget=16, system=name, max_model_len=64)
        for rid, prompt, n in requests:
            core.add_request(rid, prompt, greedy(n, ignore_eos=True))
        results[name] = {rid: o.outputs[0].token_ids for rid, o in run_all(core).items()}
        assert core.pool.num_in_use == 0
        if name != "pagedserve":
            for out in ex.steps:  # the shadow engine checked every KV slot; tables are consecutive ids
                for s in out.sequences:
                    assert s.block_table == list(range(s.block_table[0], s.block_table[0] + len(s.block_table)))
    assert results[system] == results["pagedserve"]


def test_max_reservations_limit_concurrency_where_paged_blocks_do_not(tokenizer):
    most = {}
    for name in ("pagedserve", "orca-max"):
        # 16 blocks per Orca-Max reservation: 4 fit in the arena.
        core, ex = make_core(tokenizer, num_blocks=64, block_size=4, budget=64, max_seqs=32, system=name,
                             max_model_len=64)
        for i in range(12):
            core.add_request(f"r{i}", [30 + i] * 4, greedy(6, ignore_eos=True))
        run_all(core)
        most[name] = max(len(o.sequences) for o in ex.steps)
    assert most["orca-max"] == 4 and most["pagedserve"] == 12


def test_parallel_sampling_is_rejected_by_the_baselines_naming_the_field(tokenizer):
    core, _ = make_core(tokenizer, system="orca-oracle")
    with pytest.raises(InvalidRequestError) as e:
        core.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=4))
    assert e.value.field == "n"
    with pytest.raises(InvalidRequestError) as e:
        core.add_request("y", [5, 6, 7], SamplingParams(max_tokens=10_000))
    assert e.value.field == "max_tokens"
    assert not core.has_unfinished()
