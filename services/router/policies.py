"""Routing policies: rank the live replicas for one request, best first, then the runners-up in retry order
(the few the proxy may try, not the whole fleet: see RANKED).

A request for a LoRA adapter weighs, besides prefix hit and load, what loading the adapter costs where it
is not resident (the replica loads it on demand, services/replica/lora_demand.py): the replica's own
measured load time (ReplicaInfo.adapter_load_seconds), in units of
load (requests in flight) through the router's measured mean request time, so a fast load on an idle
replica beats a queue behind a resident copy and a slow one does not.

Every choice is a function of the registry snapshot and the request alone (ties broken by rendezvous
hashing, never by chance), so any number of routers reading one Redis make the same choice. Only
round-robin keeps a counter, which is its definition.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import xxhash

from services.registry.model import ReplicaState

# Prefix affinity pays only when the cached part is a real share of the prompt: a shared chat-template
# header of one block is not worth sending everyone to one replica.
MIN_MATCH_RATIO = 0.3
MIN_MATCH_TOKENS = 256
# Hot-spot guard: a replica whose load exceeds the least loaded one's by more than
# max(GUARD_ABS, GUARD_REL * least) loses its affinity; load wins. At 4, ordinary Poisson bunching of one
# prefix's requests (two in flight on average) tripped it: `bench index` lost 3-5% of the oracle's cached
# tokens and put 1.3-1.6x the fair share on some replica at 100 replicas; 8 keeps both exact there and
# still spills a hot prefix (SGLang's router waits for an imbalance of 32).
GUARD_ABS = 8
GUARD_REL = 0.5
# Replicas ranked per request: the chosen one and its runners-up for retries (the proxy tries at most 3).
# Ordering the whole fleet would cost O(replicas log replicas) per request, and hashing every replica
# for ties O(replicas) hashes; instead one pass of plain tuples picks the few, and only ties among
# those few are hashed.
RANKED = 4
# Replicas tied with the k-th that rendezvous hashing chooses among: the TIE_SAMPLE smallest ids. A fleet
# of idle, equal replicas would otherwise be hashed whole on every request; 16 still spread new prefixes
# (and several routers' choices) widely, and a decision reads only that many of them (load_order.py).
TIE_SAMPLE = 16
# An adapter's load cost where nothing is measured yet: more than any queue, so residency wins; finite, so
# replicas that must load it still rank among themselves by load.
UNMEASURED_COST = 1e6


@dataclass(slots=True)
class RouteRequest:
    block_hashes: list[int]  # full blocks of the prompt, hashed with the replicas' seed
    prompt_tokens: int
    block_size: int
    session_id: str | None = None
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)
    adapter_digest: str = ""
    request_seconds: float = 0.0  # the router's measured mean duration of a request to this model (0: none yet)

    @property
    def key(self) -> str:
        """What rendezvous hashing spreads on: the shallowest prefix worth sharing (useful_blocks), else the
        length. Not the first block: a chat-template header every prompt starts with would send every tie
        to one replica (`bench index` put 1.9x the fair share on it once caches were full)."""
        if not self.block_hashes:
            return f"len:{self.prompt_tokens}"
        return str(self.block_hashes[min(len(self.block_hashes), useful_blocks(self)) - 1])


def rendezvous(key: str, replica_id: str) -> int:
    """Highest-random-weight hashing: every router ranks replicas for a key identically."""
    return xxhash.xxh3_64_intdigest(f"{key}|{replica_id}".encode())


def resident(r: ReplicaState, req: RouteRequest) -> bool:
    """Whether the request's adapter (these very weights) is loaded on the replica; always for the base."""
    return req.adapter is None or r.info.adapters.get(req.adapter) == req.adapter_digest


def adapter_cost(r: ReplicaState, req: RouteRequest, measured_load_seconds: float) -> float:
    """What loading the adapter on `r` first costs, in requests in flight: its load time over the share of
    a batch one request takes (mean request time / capacity). 0 where resident; UNMEASURED_COST while the
    load or the request time is unknown, so the resident replicas come first until a measure says otherwise
    (a saturated resident replica is skipped altogether, and then another loads the adapter)."""
    if resident(r, req):
        return 0.0
    load_seconds = r.info.adapter_load_seconds or measured_load_seconds
    if req.request_seconds <= 0 or load_seconds <= 0:
        return UNMEASURED_COST
    return load_seconds * max(1, r.info.capacity) / req.request_seconds


def effective_loads(replicas: list[ReplicaState], req: RouteRequest) -> list[float]:
    """Each replica's requests in flight plus the adapter's load cost there, in the order of `replicas`. A
    replica that never loaded an adapter is charged the slowest load its model's replicas measured."""
    if req.adapter is None:
        return [r.load.num_waiting + r.load.num_running for r in replicas]
    fleet = max((r.info.adapter_load_seconds for r in replicas), default=0.0)
    return [r.load.requests + adapter_cost(r, req, fleet) for r in replicas]


def _top(replicas: list[ReplicaState], req: RouteRequest, keys: list[tuple], k: int) -> list[ReplicaState]:
    """The k replicas of smallest key (keys[i] is replicas[i]'s), ties broken by rendezvous hashing among the
    TIE_SAMPLE smallest replica ids tied with the k-th: only those are hashed."""
    if len(replicas) > k:
        cut = heapq.nsmallest(k, keys)[-1]
        picked = [i for i, key in enumerate(keys) if key < cut]
        tied = [i for i, key in enumerate(keys) if key == cut]
        if len(tied) > TIE_SAMPLE:
            tied = heapq.nsmallest(TIE_SAMPLE, tied, key=lambda i: replicas[i].info.replica_id)
        picked += tied
    else:
        picked = range(len(replicas))
    picked = sorted(picked, key=lambda i: (keys[i], -rendezvous(req.key, replicas[i].info.replica_id)))
    return [replicas[i] for i in picked[:k]]


def _top_by_load(replicas: list[ReplicaState], loads: list[float], req: RouteRequest, k: int, tie_keys,
                 skip: int = -1) -> list[ReplicaState]:
    """The k replicas (all but replicas[skip]) of smallest (load, *tie_keys(replica)). Only those whose load
    is within the k smallest loads can be among them, so only those get a full key: at 1,000 replicas
    one pass over plain floats instead of building a tuple per replica."""
    idx = [i for i in range(len(replicas)) if i != skip]
    if len(idx) > k:
        cut = heapq.nsmallest(k, [loads[i] for i in idx])[-1]
        idx = [i for i in idx if loads[i] <= cut]
    return _top([replicas[i] for i in idx], req, [(loads[i], *tie_keys(replicas[i])) for i in idx], k)


def _least_loaded_keys(req: RouteRequest):
    """Ties among equal loads: where the adapter is resident, then the least KV in use, then the least cached."""
    return lambda r: (not resident(r, req), r.load.kv_usage, r.load.cached_blocks)


def least_loaded(replicas: list[ReplicaState], req: RouteRequest, k: int = RANKED) -> list[ReplicaState]:
    """The k least loaded (the adapter's load cost counted); among equals, where the adapter is resident,
    then the least KV in use, then the least cached."""
    return _top_by_load(replicas, effective_loads(replicas, req), req, k, _least_loaded_keys(req))


def useful_blocks(req: RouteRequest) -> int:
    """The fewest leading blocks a cached prefix needs for PrefixPolicy to act on it (what the index
    need not resolve below)."""
    by_ratio = -(-int(MIN_MATCH_RATIO * req.prompt_tokens) // req.block_size)
    return max(1, min(by_ratio, -(-MIN_MATCH_TOKENS // req.block_size)))


def match_ratio(r: ReplicaState, req: RouteRequest) -> float:
    return r.matched_blocks * req.block_size / req.prompt_tokens if req.prompt_tokens else 0.0


class PrefixPolicy:
    name = "prefix"

    def rank(self, replicas: list[ReplicaState], req: RouteRequest) -> list[ReplicaState]:
        if not replicas:
            return []
        loads = effective_loads(replicas, req)
        min_load = min(loads)
        limit = min_load + max(GUARD_ABS, GUARD_REL * min_load)
        # Affinity: the deepest match within the guard, then the lighter load, where the adapter is resident.
        eligible = [i for i, r in enumerate(replicas) if r.matched_blocks and loads[i] <= limit]
        best = None
        if eligible:
            keys = [(-replicas[i].matched_blocks, loads[i], not resident(replicas[i], req)) for i in eligible]
            best = _top([replicas[i] for i in eligible], req, keys, 1)[0]
        worth_it = best is not None and (
            match_ratio(best, req) >= MIN_MATCH_RATIO or best.matched_blocks * req.block_size >= MIN_MATCH_TOKENS)
        if worth_it:
            skip = next(i for i in eligible if replicas[i] is best)
            return [best, *_top_by_load(replicas, loads, req, RANKED - 1, _least_loaded_keys(req), skip)]
        # No useful affinity: least loaded (the adapter's load cost counted); among equals, where the adapter
        # is resident, then the one caching least, where a new prefix fits.
        return _top_by_load(replicas, loads, req, RANKED,
                            lambda r: (not resident(r, req), r.load.cached_blocks, r.load.kv_usage))


class LeastLoadedPolicy:
    name = "least-loaded"

    def rank(self, replicas: list[ReplicaState], req: RouteRequest) -> list[ReplicaState]:
        return least_loaded(replicas, req)


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def rank(self, replicas: list[ReplicaState], req: RouteRequest) -> list[ReplicaState]:
        if not replicas:
            return []
        ordered = sorted(replicas, key=lambda r: r.info.replica_id)
        start = next(self._next) % len(ordered)
        return (ordered[start:] + ordered[:start])[:RANKED]


class SessionPolicy:
    """Sticky by `x-session-id` (rendezvous: a session moves only when its replica goes away);
    requests without the header are routed by prefix."""

    name = "session"

    def __init__(self) -> None:
        self._fallback = PrefixPolicy()

    def rank(self, replicas: list[ReplicaState], req: RouteRequest) -> list[ReplicaState]:
        if not req.session_id:
            return self._fallback.rank(replicas, req)
        return heapq.nsmallest(RANKED, replicas, key=lambda r: -rendezvous("session:" + req.session_id,
                                                                        r.info.replica_id))


def shortlists(policy, req: RouteRequest) -> bool:
    """Whether `policy` chooses for `req` among ReplicaView.shortlist's few replicas what it would among them
    all: prefix and least-loaded ranking of a base-model request. Not an adapter's (its load cost differs per
    replica), and not session or round-robin routing, which look at every replica."""
    if req.adapter is not None:
        return False
    if isinstance(policy, SessionPolicy):
        return not req.session_id
    return isinstance(policy, PrefixPolicy | LeastLoadedPolicy)


def make_policy(name: str):
    policies = {"prefix": PrefixPolicy, "least-loaded": LeastLoadedPolicy, "round-robin": RoundRobinPolicy,
                "session": SessionPolicy}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
