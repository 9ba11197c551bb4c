"""Faults under load on `pagedserve up --replicas 2` (real processes, real Redis, a tiny model): the
scenarios of `pagedserve bench chaos` with smaller figures. Each must lose nothing it did not have to:
no hung request, no 5xx, every failure a clear error, every KV block back once the load ends."""

from __future__ import annotations

import pytest

from services.bench.fleet.chaos import ChaosConfig, run_scenarios
from services.commands.ports import free_port_run

pytestmark = pytest.mark.reliability

CONFIG = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=4, max_queue=16, streams=8, stream_tokens=64,
              redis_outage=5.0, outage_clients=3, dropped=40, burst=150, settle=10.0, hang_timeout=120.0,
              max_model_len=512)


@pytest.fixture(scope="module")
def results(tiny_llama_dir):
    return run_scenarios(ChaosConfig(model=str(tiny_llama_dir), **CONFIG), free_port_run(1), progress=print)


def _by_prefix(results, prefix: str):
    return next(r for r in results if r.name.startswith(prefix))


def _no_loss(r) -> None:
    k = r.counts
    assert k.get("hung", 0) == 0, r
    assert k.get("5xx", 0) == 0, r
    assert k.get("no_response", 0) == 0, r
    assert r.blocks_held_after == 0, f"{r.name}: {r.blocks_held_after} KV blocks still held"


def test_a_killed_engine_fails_its_streams_clearly_and_its_replica_returns(results):
    r = _by_prefix(results, "engine killed")
    _no_loss(r)
    k = r.counts
    assert k["completed"] + k.get("clear_error", 0) == k["sent"] == CONFIG["streams"]
    assert k["completed"] >= 1, "the other replica's streams must finish"
    assert r.recovery_s is not None and r.recovery_s < 60


def test_a_redis_outage_fails_nothing(results):
    r = _by_prefix(results, "Redis stopped")
    _no_loss(r)
    assert r.counts["completed"] == r.counts["sent"] > 10


def test_dropped_streams_give_back_every_block(results):
    r = _by_prefix(results, f"{CONFIG['dropped']} clients drop")
    _no_loss(r)
    # Past what the cluster holds (2 replicas x 2 x max_num_seqs, plus the router's queue) a client is told
    # to come back (429): the rest left after their first token, and their blocks must all be back.
    assert r.counts["dropped"] + r.counts.get("429", 0) == CONFIG["dropped"] and r.counts["dropped"] >= 24


def test_a_draining_scheduler_finishes_what_it_holds(results):
    r = _by_prefix(results, "scheduler SIGTERMed")
    _no_loss(r)
    assert r.counts["completed"] == r.counts["sent"] == CONFIG["streams"] // 2
    assert r.recovery_s is not None


def test_an_overload_burst_is_served_or_refused_with_retry_after(results):
    r = _by_prefix(results, f"{CONFIG['burst']} requests")
    _no_loss(r)
    k = r.counts
    assert k["completed"] + k.get("429", 0) == k["sent"] == CONFIG["burst"]
    assert k.get("429", 0) == k.get("429_with_retry_after", 0) > 0  # it was an overload, and said so
    assert k["completed"] >= 2 * CONFIG["max_num_seqs"]
    assert r.rss_mb_after < r.rss_mb_before * 1.5 + 200  # memory stays bounded
