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
