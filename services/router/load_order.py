"""Each model's replicas in the orders the policies rank loads by, kept up to date as records change, so a
routing decision reads the few least-loaded replicas and the prompt's holders instead of the fleet.

PrefixPolicy and LeastLoadedPolicy pick, besides the holders of the prompt's prefix, the k replicas of
smallest (load, kv_usage, cached_blocks) or (load, cached_blocks, kv_usage), ties among exact equals broken
by rendezvous hashing among the TIE_SAMPLE smallest ids tied with the k-th. A decision's load is the
published one lifted by the router's own requests in flight (never lowered), so scanning an order sorted by
published key finds the k smallest lifted keys exactly: once the next replica's published key exceeds the
k-th smallest lifted key seen, no later one can beat it. The scan passes over the k, at most TIE_SAMPLE + 1
replicas tied with the k-th, and those this router lifted since their last publish (a cheap check each):
not the fleet. When records change, only the changed replicas move in the orders: those ReplicaRecords'
journal names, or else those found changed by object identity (it keeps an unchanged record's object).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass, field

from services.registry.model import ModelIdentity, ReplicaLoad, ReplicaState
from services.router.policies import TIE_SAMPLE

# (load, first tie key, second tie key, replica id, state): unique by id, so never compared past it.
Entry = tuple


def by_kv(load: ReplicaLoad, requests: float) -> tuple:
    return (requests, load.kv_usage, load.cached_blocks)


def by_cached(load: ReplicaLoad, requests: float) -> tuple:
    return (requests, load.cached_blocks, load.kv_usage)


ORDERS = (by_kv, by_cached)
# Beyond this share of the records changed at once, sorting afresh is cheaper than moving each.
REBUILD_SHARE = 0.25


@dataclass
class ModelOrder:
    """One model's healthy replicas, sorted by each of ORDERS on published loads."""

    lists: tuple[list[Entry], ...] = field(default_factory=lambda: tuple([] for _ in ORDERS))
    entries: dict[str, tuple[Entry, ...]] = field(default_factory=dict)  # replica id -> its entry per order

    @property
    def count(self) -> int:
        return len(self.entries)

    def add(self, s: ReplicaState, sort: bool = True) -> None:
        rid, req = s.info.replica_id, s.load.requests
        es = tuple((*key(s.load, req), rid, s) for key in ORDERS)
        self.entries[rid] = es
        for lst, e in zip(self.lists, es, strict=True):
            if sort:
                insort(lst, e)
            else:
                lst.append(e)

    def remove(self, rid: str) -> None:
        for lst, e in zip(self.lists, self.entries.pop(rid), strict=True):
            del lst[bisect_left(lst, e)]

    def move(self, s: ReplicaState) -> None:
        """A replica of this order with a new load: where its keys did not change (a cached-block count
        moved in one order, not in the other) the entry is replaced in place."""
        rid, req = s.info.replica_id, s.load.requests
        old = self.entries[rid]
        es = tuple((*key(s.load, req), rid, s) for key in ORDERS)
        self.entries[rid] = es
        for lst, o, e in zip(self.lists, old, es, strict=True):
            i = bisect_left(lst, o)
            if o[:3] == e[:3]:
                lst[i] = e
            else:
                del lst[i]
                insort(lst, e)


class LoadOrders:
    """Every model's ModelOrder over the healthy replicas of the records last given (a filter that changes
    on its own, like Kubernetes readiness, is applied by the scan instead)."""

    def __init__(self) -> None:
        self.models: dict[ModelIdentity, ModelOrder] = {}
        self._of: list[ReplicaState] | None = None  # the records these orders reflect
        self._order_of: dict[str, ModelOrder] = {}  # replica id -> the order it is in (healthy ones)
        self._state_of: dict[str, ReplicaState] = {}

    def update(self, states: list[ReplicaState], changed: list[ReplicaState] | None = None) -> None:
        """Reflect these records (a no-op for the list already reflected). `changed`: the states in `states`
        that may differ from the list reflected, when the caller knows (ReplicaRecords.changed_since), so
        the cost is O(changes); None compares them all by identity."""
        if states is self._of:
            return
        if changed is None or self._of is None:
            new = {s.info.replica_id: s for s in states}
            changed = [s for rid, s in new.items() if self._state_of.get(rid) is not s]
            gone = [rid for rid in self._state_of if rid not in new]
            if self._of is None or len(changed) + len(gone) > REBUILD_SHARE * max(1, len(states)):
                self._rebuild(states)
                self._of, self._state_of = states, new
                return
            for rid in gone:
                self._drop(rid)
                del self._state_of[rid]
        for s in changed:
            self._move(s)
        self._of = states

    def _move(self, s: ReplicaState) -> None:
        rid = s.info.replica_id
        old = self._state_of.get(rid)
        if old is s:
            return
        if old is not None and old.info is s.info and s.load.healthy and rid in self._order_of:
            self._order_of[rid].move(s)  # the common case: only its load moved
        else:
            self._drop(rid)
            self._put(s, sort=True)
        self._state_of[rid] = s

    def _rebuild(self, states: list[ReplicaState]) -> None:
        self.models, self._order_of = {}, {}
        for s in states:
            self._put(s, sort=False)
        for m in self.models.values():
            for lst in m.lists:
                lst.sort()

    def _put(self, s: ReplicaState, sort: bool) -> None:
        if not s.load.healthy:
            return
        order = self.models.setdefault(s.info.identity, ModelOrder())
        order.add(s, sort)
        self._order_of[s.info.replica_id] = order

    def _drop(self, rid: str) -> None:
        order = self._order_of.pop(rid, None)
        if order is not None:
            order.remove(rid)


def lifted(s: ReplicaState, inflight: int) -> ReplicaState:
    """`s` with the router's own requests in flight, where they exceed what it published."""
    if inflight <= s.load.requests:
        return s
    load = ReplicaLoad(s.load.num_waiting, inflight - s.load.num_waiting, s.load.kv_usage, s.load.healthy,
                       s.load.cached_blocks)
    return ReplicaState(s.info, load, s.matched_blocks)


def least(order: list[Entry], key: Callable[[ReplicaLoad, float], tuple], k: int, inflight: dict[str, int],
          unusable: Callable[[ReplicaState, float], bool]) -> list[ReplicaState]:
    """The k replicas of smallest lifted key that are not unusable(state, lifted load) (saturated, or not
    allowed now), and of those tied with the k-th at least the TIE_SAMPLE + 1 smallest ids."""
    best: list[tuple] = []  # the k smallest lifted keys so far, ascending
    seen: list[tuple[tuple, ReplicaState]] = []
    get = inflight.get
    tied = 0  # replicas read, not lifted, whose key equals the (then final) cut
    for e in order:
        if len(best) >= k and e[:3] > best[-1]:
            break
        s = e[4]
        req = s.load.requests
        local = get(e[3], 0)
        if local > req:  # lifted by this router's requests since its last publish
            req = local
            ek = key(s.load, req)
            if len(best) >= k and ek > best[-1]:
                continue
            s, static_tie = lifted(s, local), False
        else:
            ek = e[:3]
            # Once k are found, a published key equal to the cut makes the cut final (later keys are no
            # smaller), and the policy hashes only the TIE_SAMPLE smallest ids tied with it (one more for the
            # holder it may skip): in this order they come first.
            static_tie = len(best) >= k and ek == best[-1]
        if unusable(s, req):
            continue
        if static_tie:
            tied += 1
            if tied > TIE_SAMPLE + 1:
                break
        seen.append((ek, s))
        insort(best, ek)
        if len(best) > k:
            best.pop()
    if not best:
        return []
    cut = best[-1]
    return [s for ek, s in seen if ek <= cut]
