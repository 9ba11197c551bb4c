"""`bench index`: a small simulated fleet through the real publisher, sink and index, on a real Redis and a
real local Redis Cluster, with the H200-rate replay."""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import pytest

from services.bench.index.fleet_sim import FakeReplica
from services.bench.index.replay import encode, record
from services.bench.index.run import run_fleet
from services.commands.cli import main
from services.registry.index_grid import STRIDE


def _args(**kw) -> argparse.Namespace:
    base = dict(seed=0, capacity=4000, cached_blocks=20, groups_per_replica=1, questions=3, min_decisions=40,
                hold=0, publish_every=5, event_seconds=0.2, event_scale=0.05, replay_seconds=0.2, write_rate=1000.0,
                writers=1, special_decisions=5)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("where", ["redis_server", "redis_cluster"])
def test_a_small_fleet_routes_like_the_oracle_and_absorbs_the_replay(where, request):
    url = request.getfixturevalue(where).url
    r = asyncio.run(run_fleet(url, 6, _args()))
    assert r.decisions >= 40  # rounds of fresh groups until --min-decisions
    assert r.oracle_fraction > 0.9 and r.busiest_vs_fair <= 3
    assert r.redis_us_per_decision > 0 and r.decision_p99_ms >= r.decision_p50_ms > 0
    assert "zcount" in r.redis_by_command and r.redis_by_command["zcount"]["calls_per_decision"] > 0
    # The decisions ran while writer processes filed the fleet's block events (ZREM is only theirs). Only
    # every STRIDE-th position is filed: the rate is high enough that a loaded machine's short decision
    # phase still sees filed positions (at 200 events/s it once saw none).
    w = r.write_load
    assert w["target_events_per_s"] == 6 * 1000 and w["events_per_s"] > 0 and w["writes_per_s"] > 0
    assert w["zadd_calls"] > 0 and "zrem" in r.redis_by_command
    assert {k: v["decisions"] for k, v in r.whole_fleet_decisions.items()} == {"session": 5, "lora": 5}
    p = r.replay
    # Every write the six replicas' publishers made in 0.2 s of fleet time reached the index (none refused),
    # and only the filed positions were written: about one block event in STRIDE.
    assert p["index_writes"] > 0 and p["writes_per_s"] > 0 and p["redis_us_per_write"] > 0
    assert p["block_events"] / STRIDE * 0.7 <= p["index_writes"] <= p["block_events"] / STRIDE * 1.3


def test_the_recorded_writes_are_the_sinks_commands():
    commands, events = asyncio.run(record(FakeReplica, 2, 2000, 0.1, "ns:", random.Random(1)))
    assert events == 2 * 20 * 2 * 5  # 2 replicas x 20 stored + 20 evicted per 20 ms tick x 5 ticks
    assert {c[0] for c in commands} == {"ZADD", "ZREM"}
    assert all(c[1].startswith("ns:blk:{") for c in commands)
    assert encode(("ZREM", "k", "7")) == b"*3\r\n$4\r\nZREM\r\n$1\r\nk\r\n$1\r\n7\r\n"


def test_the_command_runs_its_own_redis_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "index.json"
    rc = main(["bench", "index", "--replicas", "3", "--cached-blocks", "10", "--questions", "2",
               "--min-decisions", "20", "--event-seconds", "0.2", "--event-scale", "0.05", "--replay-seconds", "0.1",
               "--passes", "2", "--write-rate", "50", "--special-decisions", "3", "--stride-decisions", "60",
               "--stride-replicas", "3", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (row,) = report["fleet"]
    stride, exact = report["stride_cost"]
    assert (stride["grid"], exact["grid"]) == ("dense 8, stride 8 (the system's)", "exact")
    assert stride["decisions"] == exact["decisions"] == 60 and stride["index_writes"] < exact["index_writes"]
    assert 0 < stride["cached_blocks"] <= stride["best_blocks"] <= stride["prompt_blocks"]
    assert len(row["runs_decision_p99_ms"]) == 2 and len(row["runs_redis_us_per_decision"]) == 2
    for key in ("replicas", "decision_p50_ms", "decision_p99_ms", "redis_us_per_decision", "router_us_per_decision",
                "oracle_fraction", "busiest_vs_fair", "replay", "redis_by_command", "write_load",
                "whole_fleet_decisions"):
        assert key in row
    printed = capsys.readouterr().out
    assert "H200 rate, replayed" in printed and "medians of 2 passes" in printed
    assert "(the system's) at 3 replicas against the exact index" in printed


def test_the_bench_router_exits_when_the_bench_goes_away(redis_server):
    """A bench that dies without saying close (killed, crashed): the router process sees the pipe's end and
    exits, instead of spinning on an EOF pipe forever."""
    from services.bench.index.fleet_sim import BLOCK, SEED
    from services.bench.index.router_process import RouterProcess
    from services.registry.model import ModelIdentity

    router = RouterProcess(redis_server.url, ModelIdentity("m", BLOCK, SEED), BLOCK)
    router._conn.close()  # the bench's end of the pipe goes away
    router._proc.wait(timeout=15)
    assert router._proc.returncode is not None
