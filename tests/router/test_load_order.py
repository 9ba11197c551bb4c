"""ReplicaView.shortlist: the policies choose among the prompt's holders and the few least-loaded replicas
exactly what they would among the whole fleet, whatever the loads, ties, lifts, health and saturation."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from services.registry.model import ReplicaInfo, ReplicaLoad, ReplicaState
from services.router.load_order import LoadOrders, by_kv, least
from services.router.metrics import RouterMetrics
from services.router.policies import RANKED, LeastLoadedPolicy, PrefixPolicy, RouteRequest, useful_blocks
from services.router.replicas import ReplicaView, saturated


class FixedIndex:
    """An index whose records are a fixed list (one object while unchanged, as ReplicaRecords keeps it)."""

    def __init__(self, states: list[ReplicaState], holders: list[ReplicaState]):
        self.states, self.holders = states, holders

    async def lookup(self, block_hashes, min_blocks=1):
        return self.states, self.holders

    async def snapshot(self, block_hashes, min_blocks=1):
        by_id = {h.info.replica_id: h for h in self.holders}
        return [by_id.get(s.info.replica_id, s) for s in self.states]


class JournalIndex(FixedIndex):
    """A FixedIndex that, like RedisIndex, says which records changed since a version (None when replicas
    joined or left), so the view moves only those in its orders."""

    def __init__(self, states, holders):
        super().__init__(states, holders)
        self.version, self.changes = 0, {}

    def replace(self, states, holders):
        old = {s.info.replica_id: s for s in self.states}
        same = old.keys() == {s.info.replica_id for s in states}
        self.version += 1
        self.changes[self.version] = [s for s in states if old.get(s.info.replica_id) is not s] if same else None
        self.states, self.holders = states, holders

    def changes_since(self, version):
        if version < 0 or any(self.changes[v] is None for v in range(version + 1, self.version + 1)):
            return self.version, self.states, None
        return self.version, self.states, [s for v in range(version + 1, self.version + 1) for s in self.changes[v]]


replica = st.tuples(st.integers(0, 6), st.integers(0, 6), st.sampled_from([0.0, 0.25, 0.5]), st.integers(0, 3),
                    st.booleans(), st.integers(0, 12), st.sampled_from([0, 0, 0, 8, 16, 40]), st.booleans())


class EveryOther:
    """A replica filter that moves on its own (like readiness): it allows even-numbered replicas."""

    def allows(self, info: ReplicaInfo) -> bool:
        return int(info.replica_id[1:]) % 2 == 0


def _fleet(rows):
    states, holders, inflight = [], [], {}
    for i, (waiting, running, kv, cached, healthy, local, matched, other_model) in enumerate(rows):
        info = ReplicaInfo(f"r{i:02d}", f"http://r{i}", "other" if other_model and i else "m", 16, 4096, 2, 7)
        s = ReplicaState(info, ReplicaLoad(waiting, running, kv, healthy, cached))
        states.append(s)
        if matched:
            holders.append(ReplicaState(info, s.load, matched))
        if local:
            inflight[info.replica_id] = local
    return states, holders, inflight


@settings(max_examples=150, deadline=None)
@given(st.lists(replica, min_size=1, max_size=40), st.lists(replica, min_size=1, max_size=40),
       st.booleans(), st.booleans(), st.booleans())
def test_ranking_the_shortlist_equals_ranking_the_fleet(rows, later, prefix, filtered, journal):
    """Also after the records change (some replicas' loads move, some leave, some join: the orders move only
    those, found by identity or named by the index's journal), and with a filter that allows only some."""
    _check(rows, later, prefix, filtered, journal)


# Nearly idle, nearly equal replicas: dozens tied exactly, more than TIE_SAMPLE.
tied_replica = st.tuples(st.integers(0, 1), st.just(0), st.just(0.0), st.just(0), st.just(True), st.integers(0, 1),
                         st.sampled_from([0] * 9 + [16]), st.just(False))


@settings(max_examples=100, deadline=None)
@given(st.lists(tied_replica, min_size=20, max_size=80), st.lists(tied_replica, min_size=20, max_size=80),
       st.booleans(), st.booleans(), st.booleans())
def test_the_same_among_many_exact_ties(rows, later, prefix, filtered, journal):
    _check(rows, later, prefix, filtered, journal)


def _check(rows, later, prefix, filtered, journal=False):
    route = RouteRequest(list(range(40)), 640, 16)
    policy = PrefixPolicy() if prefix else LeastLoadedPolicy()
    index = (JournalIndex if journal else FixedIndex)(*_fleet(rows)[:2])
    view = ReplicaView(index, RouterMetrics(), EveryOther() if filtered else None)

    async def both(identity):
        short, any_usable = await view.shortlist(route.block_hashes, useful_blocks(route), identity, RANKED)
        full = [r for r in await view.snapshot(route.block_hashes, useful_blocks(route)) if r.info.identity == identity]
        return short, any_usable, full

    for step in (rows, later):
        states, holders, inflight = _fleet(step)
        if step is later:  # keep the unchanged replicas' state objects, as ReplicaRecords does
            old = {s.info.replica_id: s for s in index.states}
            states = [_kept(old.get(s.info.replica_id), s) for s in states]
        if journal:
            index.replace(states, holders)
        else:
            index.states, index.holders = states, holders
        view.inflight.clear()
        view.inflight.update(inflight)
        identity = states[0].info.identity
        short, any_usable, full = asyncio.run(both(identity))
        assert any_usable == bool(full)
        open_ = [r for r in full if not saturated(r)]
        want = [(r.info.replica_id, r.matched_blocks, r.load.requests) for r in policy.rank(open_, route)]
        got = [(r.info.replica_id, r.matched_blocks, r.load.requests) for r in policy.rank(short, route)]
        assert got == want
        assert len(short) <= len(open_)


def _kept(old: ReplicaState | None, new: ReplicaState) -> ReplicaState:
    """What ReplicaRecords holds after a refresh: the same state object when nothing changed, the same
    info object when only the load did (a load from the change stream), a new state otherwise."""
    if old is None:
        return new
    if old == new:
        return old
    return ReplicaState(old.info, new.load) if old.info == new.info else new


def test_a_large_idle_fleet_is_not_scanned():
    """900 replicas with distinct loads: the scan stops after the k smallest, whatever the fleet's size."""
    orders = LoadOrders()
    orders.update([ReplicaState(ReplicaInfo(f"r{i}", "u", "m", 16, 4096, 8, 1),
                                ReplicaLoad(0, i % 9, i / 1000, True, i)) for i in range(900)])
    (order,) = orders.models.values()
    looked = []

    def unusable(s, requests):
        looked.append(s)
        return False

    got = least(order.lists[0], by_kv, 4, {}, unusable)
    assert [s.load.requests for s in got] == [0, 0, 0, 0] and len(looked) == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0]),
                                   st.integers(0, 3), st.booleans(), st.booleans()), min_size=1, max_size=12),
                min_size=1, max_size=6))
def test_journaled_updates_keep_each_order_what_sorting_afresh_gives(steps):
    """Loads moving (in one tie key, both, or none), replicas turning unhealthy and back, infos changing:
    after every journaled update each order is exactly the sorted list a rebuild makes."""
    infos = {i: ReplicaInfo(f"r{i:02d}", "u", "m", 16, 4096, 8, 1) for i in range(12)}
    states = {i: ReplicaState(infos[i], ReplicaLoad()) for i in range(12)}
    orders = LoadOrders()
    orders.update(list(states.values()))
    for step in steps:
        changed = []
        for i, requests, kv, cached, healthy, new_info in step:
            if new_info:
                infos[i] = ReplicaInfo(f"r{i:02d}", "u", "m", 16, 4096, 8, 1)
            states[i] = ReplicaState(infos[i], ReplicaLoad(0, requests, kv, healthy, cached))
            changed.append(states[i])
        current = list(states.values())
        orders.update(current, changed)
        fresh = LoadOrders()
        fresh.update(current)
        got = {m: [[e[3] for e in lst] for lst in o.lists] for m, o in orders.models.items() if o.count}
        want = {m: [[e[3] for e in lst] for lst in o.lists] for m, o in fresh.models.items() if o.count}
        assert got == want
