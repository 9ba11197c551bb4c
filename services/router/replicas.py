"""Which replicas a request may go to now: the registry snapshot, filtered and kept usable in outages.

When the index (Redis) cannot be read, the last good snapshot stands in, without prefix matches: routing
degrades to load only and requests keep flowing. Local in-flight counts lift published load figures
between two publishes; they are the only live signal while Redis is down.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Protocol

from services.openai_api.errors import APIError
from services.registry.model import ModelIdentity, PrefixIndex, ReplicaInfo, ReplicaState, split_holders, with_holders
from services.router.load_order import ORDERS, LoadOrders, least, lifted
from services.router.metrics import RouterMetrics
from services.router.redis_index import IndexBusy

log = logging.getLogger(__name__)

# A replica is saturated when it has a full batch running and as many again waiting; beyond that a
# request waits in the router's queue, where it can still go to whichever replica frees up first.
SATURATION_FACTOR = 2
# How long an empty registry is distrusted after a non-empty one (a Redis that restarted empty).
EMPTY_GRACE = 5.0
# While the index is down, one request per this many seconds tries it again; the rest skip it.
INDEX_RETRY = 0.5
# A request for a model no known replica serves re-reads the registry at most this often.
IDENTITY_REFRESH = 0.5


@dataclass(frozen=True, slots=True)
class ServedModel:
    """How to route a request for one model name: its base model's identity, context length and
    tokenizer, and the adapter it names (None for the base model itself)."""

    identity: ModelIdentity
    max_model_len: int
    tokenizer_digest: str
    adapter: str | None = None
    adapter_digest: str = ""
    model_path: str = "pagedserve"  # how its replicas' engines run it (ReplicaInfo.model_path)


@dataclass(frozen=True, slots=True)
class KnownAdapter:
    """A LoRA adapter some replica's record named: its base model, the digest most holders hold, and who."""

    parent: str
    digest: str
    holders: frozenset[tuple[str, int]]  # (replica id, generation): a restarted replica is another holder


def remember_adapters(known: dict[str, KnownAdapter], infos: list[ReplicaInfo]) -> dict[str, KnownAdapter]:
    """The adapters the records name now, plus those whose every holder left the registry or restarted (a
    resident replica stopped or crashed: its model's replicas can still load the adapter on demand). One
    that a holder still registered, same generation, no longer lists was unloaded on purpose: forgotten."""
    out: dict[str, KnownAdapter] = {}
    for name in {n for i in infos for n in i.adapters}:
        holders = [i for i in infos if name in i.adapters]
        # Replicas may briefly disagree (a reload in place rolling out): the digest most of them hold.
        digests = Counter(i.adapters[name] for i in holders)
        digest = max(digests, key=lambda d: (digests[d], d))
        parent = min(i.model for i in holders if i.adapters[name] == digest)
        out[name] = KnownAdapter(parent, digest, frozenset((i.replica_id, i.generation) for i in holders))
    present = {(i.replica_id, i.generation) for i in infos}
    for name, adapter in known.items():
        if name not in out and not adapter.holders & present:
            out[name] = adapter
    return out


class NoReplicasError(APIError):
    """No replica is ready to take the request (none registered, healthy or allowed): the router may hold
    it while replicas start (scale from zero) instead of refusing it at once."""

    def __init__(self, message: str = "no healthy replica is registered"):
        super().__init__(503, message, code="no_replicas", headers={"Retry-After": "1"})


class ReplicaFilter(Protocol):
    def allows(self, info: ReplicaInfo) -> bool: ...


class ReplicaView:
    def __init__(self, index: PrefixIndex, metrics: RouterMetrics, replica_filter: ReplicaFilter | None = None):
        self.index = index
        self.metrics = metrics
        self.filter = replica_filter
        self.inflight: dict[str, int] = defaultdict(int)
        self._last: list[ReplicaState] = []
        self._last_at = 0.0
        self._index_down = False
        self._retry_at = 0.0
        self._identity_read_at = 0.0
        self._adapters: dict[str, KnownAdapter] = {}  # name -> where it was last seen resident
        # What each model name resolves to, re-derived (a pass over the fleet's records) only when the
        # index's catalog_version says a replica joined, left or changed what it serves.
        self._served: dict[str, ServedModel] = {}
        self._catalog_version: object = None
        self._orders = LoadOrders()
        self._orders_version = -1  # the index's records version the orders reflect (-1: not known)
        self._fresh = False  # whether the last _read returned the index's records, not the fallback
        watch = getattr(index, "watch", None)
        if watch is not None:
            watch(self._on_swap)

    async def resolve(self, model: str) -> ServedModel:
        """What serves `model` (a base model, or an adapter of one) as the registry last said.

        404 naming the served models when replicas are registered but none serves `model`;
        NoReplicasError when none is registered.
        """
        found = self._resolve(model)
        if found is None and time.monotonic() - self._identity_read_at >= IDENTITY_REFRESH:
            self._identity_read_at = time.monotonic()
            await self._read([])
            found = self._resolve(model)
        if found is not None:
            return found
        if self._last:
            names = sorted({s.info.model for s in self._last})
            raise APIError(404, f"The model `{model}` does not exist; served: {', '.join(names)}.", "model",
                           "model_not_found")
        raise NoReplicasError()

    def _resolve(self, model: str) -> ServedModel | None:
        return self._served.get(model)

    def _derive_catalog(self) -> None:
        infos = [s.info for s in self._last]
        self._adapters = remember_adapters(self._adapters, infos)
        serving: dict[str, list[ReplicaInfo]] = defaultdict(list)
        for i in infos:
            serving[i.model].append(i)
        served = {}
        for model, group in serving.items():
            identity = group[0].identity
            same = [i for i in group if i.identity == identity]
            served[model] = ServedModel(identity, min(i.max_model_len for i in same), same[0].tokenizer_digest,
                                        model_path=same[0].model_path)
        # An adapter is served by the replicas of its parent, resident or loading it on demand.
        for name, known in self._adapters.items():
            if name not in served and known.parent in served:
                served[name] = replace(served[known.parent], adapter=name if known.digest else None,
                                       adapter_digest=known.digest)
        self._served = served

    async def models(self) -> list[tuple[str, int, str | None, str]]:
        """(name, max model length, parent, model path) of every model and adapter the registry knows, for /v1/models:
        base models have no parent, adapters name the base model they run on. Read afresh (at most every
        IDENTITY_REFRESH): an adapter loaded at run time is listed before any request names it."""
        if not self._last or time.monotonic() - self._identity_read_at >= IDENTITY_REFRESH:
            self._identity_read_at = time.monotonic()
            await self._read([])
        # The catalog the routing decisions use, so /v1/models lists exactly what a request can name.
        served = sorted(self._served.items())
        return ([(name, m.max_model_len, None, m.model_path) for name, m in served if m.adapter is None]
                + [(name, m.max_model_len, self._adapters[name].parent, m.model_path) for name, m in served
                   if m.adapter is not None])

    async def snapshot(self, block_hashes: list[int], min_blocks: int = 1) -> list[ReplicaState]:
        """Every usable replica (healthy, allowed), with the prompt's matches and the local in-flight lifts:
        for the policies that look at the whole fleet (shortlist serves the others)."""
        states = with_holders(*await self._read(block_hashes, min_blocks))
        if self.filter is None:
            live = [s for s in states if s.load.healthy]
        else:
            allows = self.filter.allows
            live = [s for s in states if s.load.healthy and allows(s.info)]
        get = self.inflight.get
        live = [s if get(s.info.replica_id, 0) <= s.load.num_waiting + s.load.num_running
                else lifted(s, get(s.info.replica_id, 0)) for s in live]
        self.metrics.healthy_replicas.set(len(live))
        return live

    async def shortlist(self, block_hashes: list[int], min_blocks: int, identity, k: int
                        ) -> tuple[list[ReplicaState], bool]:
        """What a prefix or least-loaded policy can choose for this prompt among `identity`'s replicas: the
        holders of its prefix and the k least loaded in either of the policies' tie orders (with every
        replica tied with the k-th), lifted by local in-flight counts, none saturated; and whether the model
        has any usable replica (saturated or not). Ranking this list gives what ranking them all would
        (load_order), at a cost that does not grow with the fleet."""
        states, holders = await self._read(block_hashes, min_blocks)
        self._update_orders(states)
        order = self._orders.models.get(identity)
        if order is None or not order.count:
            return [], False
        get = self.inflight.get
        allows = self.filter.allows if self.filter else None
        picked: dict[str, ReplicaState] = {}
        for h in holders:
            h = lifted(h, get(h.info.replica_id, 0))
            if (h.info.identity == identity and h.load.healthy and not saturated(h)
                    and (allows is None or allows(h.info))):
                picked[h.info.replica_id] = h
        if allows is None:
            def unusable(s: ReplicaState, requests: float) -> bool:
                return requests >= saturation_load(s)
        else:
            def unusable(s: ReplicaState, requests: float) -> bool:
                return requests >= saturation_load(s) or not allows(s.info)
        for ordered, key in zip(order.lists, ORDERS, strict=True):
            for s in least(ordered, key, k, self.inflight, unusable):
                picked.setdefault(s.info.replica_id, s)
        self.metrics.healthy_replicas.set(sum(m.count for m in self._orders.models.values()))
        # Any usable replica at all (the filter moves on its own, readiness, not with the records): the first
        # one it allows ends the search.
        return list(picked.values()), allows is None or any(allows(e[4].info) for e in order.lists[0])

    def _update_orders(self, states: list[ReplicaState]) -> None:
        """The load orders brought up to the records: through the index's journal of changes where it keeps
        one (O(changes); usually nothing is left, the index's swaps having been followed as they happened),
        by comparing every record otherwise (the fallback list of an outage, an index without a journal)."""
        if getattr(self.index, "changes_since", None) is None or not self._fresh:
            self._orders_version = -1  # the next journal read cannot start from this list
            self._orders.update(states)
            return
        # The records now, which a swap during the lookup may have made newer than `states`: the orders
        # follow the journal, and the holders' loads are at most one refresh older.
        self._catch_up()

    def _catch_up(self) -> None:
        self._orders_version, current, changed = self.index.changes_since(self._orders_version)
        self._orders.update(current, changed)

    def _on_swap(self) -> None:
        """The index swapped in new records (its background refresh): the orders follow now, a chunk at a
        time, so no decision pays for a whole refresh's changes (hundreds at 1,000 replicas, milliseconds of
        sorting). Not while routing on the fallback list: the next fresh read catches up."""
        if self._fresh:
            self._catch_up()

    async def _read(self, block_hashes: list[int], min_blocks: int = 1
                    ) -> tuple[list[ReplicaState], list[ReplicaState]]:
        """(every live replica, matches 0: the same list object until the records change; the holders of
        the prompt's prefix, with their matches)."""
        now = time.monotonic()
        # Tagged with the version from before the read: the states read are at least that new, so the tag
        # is never newer than the catalog (at worst it is derived once more on the next read).
        version = getattr(self.index, "catalog_version", None)
        if self._index_down and now < self._retry_at:
            self.metrics.index_fallbacks.inc()
            return self._fallback()  # do not make every request wait for a dead Redis's timeout
        try:
            states, holders = await self._lookup(block_hashes, min_blocks)
        except IndexBusy:  # every connection busy for a while: this decision only goes on load (Redis is up)
            self.metrics.index_fallbacks.inc()
            return self._fallback()
        except Exception as exc:
            self.metrics.index_fallbacks.inc()
            if not self._index_down:
                log.warning("prefix index unreachable (%s: %s); routing on load only", type(exc).__name__, exc)
            self._index_down, self._retry_at = True, now + INDEX_RETRY
            return self._fallback()
        if self._index_down:
            log.info("prefix index reachable again; prefix routing resumed")
            self._index_down = False
            # A Redis back from an outage may be empty until every replica's next heartbeat: the grace
            # counts from now, not from the last good read before the outage.
            if self._last:
                self._last_at = now
        if states or now - self._last_at > EMPTY_GRACE:
            self._last, self._last_at, self._fresh = states, now, True
            after = getattr(self.index, "catalog_version", None)
            if after is None or after != self._catalog_version:  # O(replicas): not on every decision
                self._catalog_version = version
                self._derive_catalog()
            return states, holders
        # Redis restarted empty a moment ago: replicas re-register within a heartbeat; meanwhile the last
        # view serves (retries cover any replica that really went away).
        return self._fallback()

    async def _lookup(self, block_hashes: list[int], min_blocks: int) -> tuple[list[ReplicaState], list[ReplicaState]]:
        lookup = getattr(self.index, "lookup", None)
        if lookup is not None:
            return await lookup(block_hashes, min_blocks)
        # An index with only snapshot(): split it (a pass over the fleet; the registry's own indexes do not).
        return split_holders(await self.index.snapshot(block_hashes, min_blocks))

    def _fallback(self) -> tuple[list[ReplicaState], list[ReplicaState]]:
        self._fresh = False
        return self._last, []

    async def claim(self, replica_id: str, block_hashes: list[int], held: int = 0) -> None:
        if self._index_down:
            return
        try:
            await self.index.claim(replica_id, block_hashes, held)
        except Exception as exc:  # a lost claim only costs one possible cache miss
            log.debug("prefix claim failed: %s", exc)

def saturation_load(s: ReplicaState) -> int:
    return SATURATION_FACTOR * max(1, s.info.capacity)


def saturated(s: ReplicaState) -> bool:
    return s.load.requests >= saturation_load(s)
