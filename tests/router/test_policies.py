"""Routing policies as pure functions of a registry snapshot: affinity, the hot-spot guard, ties."""

from __future__ import annotations

from services.registry.model import ReplicaInfo, ReplicaLoad, ReplicaState
from services.router.policies import (
    GUARD_ABS,
    LeastLoadedPolicy,
    PrefixPolicy,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
    make_policy,
)


def state(rid: str, matched: int = 0, running: int = 0, waiting: int = 0, cached: int = 0) -> ReplicaState:
    info = ReplicaInfo(rid, f"http://{rid}", "m", 16, 4096, 8, 1)
    return ReplicaState(info, ReplicaLoad(waiting, running, 0.0, True, cached), matched)


def request(blocks: int = 25, tokens: int = 410, session: str | None = None) -> RouteRequest:
    return RouteRequest(list(range(1000, 1000 + blocks)), tokens, 16, session)


def ids(ranked) -> list[str]:
    return [r.info.replica_id for r in ranked]


def test_prefix_affinity_wins_within_the_guard_and_loses_beyond_it():
    policy = PrefixPolicy()
    assert ids(policy.rank([state("a"), state("b", matched=25, running=GUARD_ABS), state("c")], request()))[0] == "b"
    hot = [state("a"), state("b", matched=25, running=GUARD_ABS + 1), state("c", running=1)]
    assert ids(policy.rank(hot, request())) == ["a", "c", "b"]
    # The guard scales with load: at 20 requests each, 9 more is within half of the least loaded.
    busy = [state("a", running=20), state("b", matched=25, running=29)]
    assert ids(policy.rank(busy, request()))[0] == "b"


def test_a_small_shared_header_is_not_worth_affinity():
    policy = PrefixPolicy()
    ranked = policy.rank([state("a", matched=1, running=2), state("b", running=0)], request(tokens=600))
    assert ids(ranked)[0] == "b"
    # ... but a long cached prefix is, even when it is a small share of an even longer prompt.
    ranked = policy.rank([state("a", matched=20, running=2), state("b")], request(blocks=200, tokens=3200))
    assert ids(ranked)[0] == "a"


def test_new_prefixes_go_where_load_and_cache_are_lightest_and_all_routers_agree():
    policy = PrefixPolicy()
    replicas = [state("a", cached=50), state("b", cached=10), state("c", cached=30)]
    assert ids(policy.rank(replicas, request())) == ["b", "c", "a"]
    even = [state("a"), state("b"), state("c")]
    firsts = {ids(PrefixPolicy().rank(even, RouteRequest([k], 16, 16)))[0] for k in range(30)}
    assert firsts == {"a", "b", "c"}  # rendezvous spreads keys...
    assert ids(PrefixPolicy().rank(even, request())) == ids(PrefixPolicy().rank(list(reversed(even)), request()))


def test_other_policies():
    replicas = [state("a", running=3), state("b", running=1), state("c", running=2)]
    assert ids(LeastLoadedPolicy().rank(replicas, request())) == ["b", "c", "a"]
    rr = RoundRobinPolicy()
    assert [ids(rr.rank(replicas, request()))[0] for _ in range(4)] == ["a", "b", "c", "a"]
    sticky = SessionPolicy()
    first = ids(sticky.rank(replicas, request(session="s1")))[0]
    assert all(ids(sticky.rank(replicas[::-1], request(blocks=3, session="s1")))[0] == first for _ in range(3))
    assert make_policy("least-loaded").name == "least-loaded"


def adapter_state(rid: str, resident: bool, running: int = 0, load_seconds: float = 0.0,
                  matched: int = 0) -> ReplicaState:
    info = ReplicaInfo(rid, f"http://{rid}", "m", 16, 4096, 8, 1, adapters={"sql": "aa" * 32} if resident else {},
                       adapter_load_seconds=load_seconds)
    return ReplicaState(info, ReplicaLoad(0, running, 0.0, True, 0), matched)


def adapter_request(request_seconds: float, matched_blocks: int = 25) -> RouteRequest:
    return RouteRequest(list(range(1000, 1000 + matched_blocks)), 410, 16, None, "sql", "aa" * 32, request_seconds)


def test_an_adapters_measured_load_cost_is_weighed_against_load():
    policy = PrefixPolicy()
    # Nothing measured yet (no request time, or no load time anywhere): resident replicas first, however
    # busy, and the others by load behind them.
    assert ids(policy.rank([adapter_state("a", False), adapter_state("b", True)], adapter_request(0)))[0] == "b"
    unmeasured = [adapter_state("a", False, running=2), adapter_state("b", True, running=30),
                  adapter_state("c", False)]
    assert ids(policy.rank(unmeasured, adapter_request(0))) == ["b", "c", "a"]
    assert ids(policy.rank(unmeasured, adapter_request(2.0))) == ["b", "c", "a"]
    # A fast load (50 ms against 2 s requests on 8 slots: 0.2 requests' worth) beats a resident copy with 3
    # requests ahead; a slow one (2 s: 8 requests' worth) does not.
    busy_resident = adapter_state("b", True, running=3)
    assert ids(policy.rank([adapter_state("a", False, load_seconds=0.05), busy_resident],
                           adapter_request(2.0)))[0] == "a"
    assert ids(policy.rank([adapter_state("a", False, load_seconds=2.0), busy_resident],
                           adapter_request(2.0)))[0] == "b"
    # A replica that never loaded one is charged the slowest load its fleet measured.
    fleet = [adapter_state("a", False), adapter_state("c", False, running=9, load_seconds=2.0), busy_resident]
    assert ids(policy.rank(fleet, adapter_request(2.0)))[0] == "b"
    # A cached prefix of the adapter's own chain pulls within the guard, measured cost included.
    cached = adapter_state("a", False, load_seconds=0.05, matched=25)
    assert ids(policy.rank([cached, adapter_state("b", True)], adapter_request(2.0)))[0] == "a"
    # The base model's requests see no adapter cost at all.
    base = RouteRequest(list(range(1000, 1025)), 410, 16)
    assert ids(LeastLoadedPolicy().rank([adapter_state("a", False), adapter_state("b", True, running=1)],
                                        base))[0] == "a"
