"""The router's in-memory copy of every replica's signed registry record (identity, load, generation).

Records are read in the background every `refresh` seconds, never per routing decision: only those
that changed since the last read (the registry's change stream, services.registry.keys), so a refresh
costs O(changes), not O(replicas). Most changes are loads alone (a request started or ended): their entry
carries the signed load, applied to the record held without reading or parsing the record, so a fleet
whose every load moves between two refreshes costs a few microseconds per replica. A replica that died
writes no change (its record just expires), so every FULL_READ_EVERY seconds EXISTS over the known records
checks they all still exist, and only if one is gone are all of them read again. Each distinct record is
verified once, and looked up by replica id or by index generation. Each swap of the records is journaled
(changed_since), so a reader's own structure over them follows in O(changes). With refresh=0 every call
re-reads them all (tests that need the registry's latest word at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis

from services.registry import keys
from services.registry.change_entry import carries_load, entry_load, entry_replica
from services.registry.model import ReplicaState, Signer, UntrustedRecord
from services.router.record_journal import RecordJournal

log = logging.getLogger(__name__)

READ_CHUNK = 250  # records read per command
PARSE_CHUNK = 10  # records parsed between two yields to the event loop
FULL_READ_EVERY = 2.0  # seconds between two checks that every record still exists (a read of all if not)
EXISTS_CHUNK = 100  # record keys per EXISTS (each chunk its own step: packing 1,000 keys held the loop 3 ms)
CLOSE_WAIT = 5.0  # seconds close() waits for the loop to stop
CHANGES_READ = 50  # change entries per XRANGE
LOAD_CHUNK = 10  # change entries whose loads are applied (and watchers told) in one step of the event loop
CHUNK_PAUSE = 0.001  # seconds between two such steps (_between_chunks)


class ReplicaRecords:
    def __init__(self, client: Redis, namespace: str, signer: Signer | None, refresh: float):
        self.client = client
        self.ns = namespace
        self.signer = signer  # with the internal token, records it cannot verify are ignored
        self.refresh = refresh
        self.states: list[ReplicaState] = []  # every live replica, matched_blocks 0
        self.position: dict[str, int] = {}  # replica id -> index in states
        self.by_generation: dict[int, str] = {}  # index generation -> replica id
        self.read_at = 0.0
        self._full_at = 0.0
        self._last_change = "0-0"  # the change stream's id up to which the records are read
        self._parsed: dict[str, tuple[bytes, ReplicaState]] = {}
        # Bumped when a replica joins, leaves or changes what it serves (ReplicaInfo.catalog_key).
        self.catalog_version = 0
        self._catalog: dict[str, tuple[object, tuple]] = {}  # replica id -> (its info, the info's key)
        self._warned: set[str] = set()
        # Each swap of `states` is journaled with the replicas it changed, and told to watchers.
        self.journal = RecordJournal()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._failing = False
        self._work_started = 0.0  # when the read or refresh under way began

    async def current(self) -> list[ReplicaState]:
        """The records, read now when they never were (or refresh is 0); raises if that read fails."""
        if self.refresh <= 0 or not self.read_at:
            await self.read()
        if self.refresh > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop())
        return self.states

    async def read(self) -> None:
        """Every record (and the change stream's position, taken first: no change after it is missed)."""
        self._work_started = time.monotonic()
        tail = await self.client.xrevrange(keys.changes_key(self.ns), "+", "-", count=1)
        ids = sorted(m.decode(errors="replace") if isinstance(m, bytes) else m
                     for m in await self.client.smembers(keys.replicas_key(self.ns)))
        states, gone, _ = await self._read_ids(ids)
        if gone:  # expired records: their ids leave the registry set (whoever notices first)
            await self.client.srem(keys.replicas_key(self.ns), *gone)
        self._install(states)
        self._last_change = _entry_id(tail[0]) if tail else "0-0"
        self._full_at = self.read_at

    async def refresh_changed(self) -> None:
        """The records written or removed since the last read; all of them when a full read is due or the
        stream was trimmed past this router's position."""
        self._work_started = time.monotonic()
        if time.monotonic() - self._full_at >= FULL_READ_EVERY:
            if await self._any_gone():
                await self.read()
                return
            self._full_at = time.monotonic()  # every record known still exists: changes say the rest
        pipe = self.client.pipeline(transaction=False)
        stream = keys.changes_key(self.ns)
        pipe.xrange(stream, "-", "+", count=1)
        pipe.xrange(stream, "(" + self._last_change, "+", count=CHANGES_READ)
        first, changes = await pipe.execute()
        if first and self._last_change != "0-0" and _newer(_entry_id(first[0]), self._last_change):
            await self.read()  # entries this router never saw were trimmed away
            return
        if not changes:
            self.read_at = time.monotonic()
            return
        # Entries are read CHANGES_READ at a time and their loads applied LOAD_CHUNK at a time, each chunk in
        # its own step of the event loop (with the watchers' work on it), so a decision waiting on Redis
        # meanwhile is held up by one small chunk at most.
        reads: set[str] = set()  # replicas whose record must be read: info changed, or the load is unusable
        while True:
            for i in range(0, len(changes), LOAD_CHUNK):
                if i:
                    await self._between_chunks()
                self._apply_loads(changes[i:i + LOAD_CHUNK], reads)
            last = _entry_id(changes[-1])
            if len(changes) < CHANGES_READ:
                break
            changes = await self.client.xrange(stream, "(" + last, "+", count=CHANGES_READ)
            if not changes:
                break
        changed = sorted(reads)
        position = self.position
        if all(rid in position for rid in changed):
            # Known replicas' records: swapped in as they are parsed, PARSE_CHUNK at a time, so neither this
            # loop nor a reader's update ever handles a whole refresh in one go.
            _, gone, rejected = await self._read_ids(changed, self._replace)
            if gone or rejected:  # expired, removed, or no longer verifying: out of the list
                drop = {*gone, *rejected}
                self._install([s for s in self.states if s.info.replica_id not in drop])
        else:
            fresh, _, _ = await self._read_ids(changed)
            by_id = {s.info.replica_id: s for s in self.states}
            for rid in changed:
                by_id.pop(rid, None)
            by_id.update((s.info.replica_id, s) for s in fresh)
            self._install([by_id[rid] for rid in sorted(by_id)])
        self._last_change = last

    async def _between_chunks(self) -> None:
        """A pause between two chunks of a refresh. A bare yield let the next chunk run before each of the
        few loop hops a waiting decision takes per Redis reply (the chunk was always ready first), adding a
        chunk per hop to its latency; a short real pause lets those hops run back to back. Once a refresh has
        taken over half its interval (a backlog) it only yields, so it still keeps up."""
        if time.monotonic() - self._work_started < self.refresh / 2:
            await asyncio.sleep(CHUNK_PAUSE)
        else:
            await asyncio.sleep(0)

    def _apply_loads(self, changes: list, reads: set[str]) -> None:
        """Swap in the loads these change entries carry (the latest per replica); note in `reads` the
        replicas whose record must be read instead (an entry without a load: the info changed), for which
        later loads are moot (the record read afterwards is newer)."""
        loads: dict[str, dict] = {}
        for _, fields in changes:
            rid = entry_replica(fields)
            if rid is None:
                continue
            if carries_load(fields) and rid not in reads:
                loads[rid] = fields
            else:
                reads.add(rid)
                loads.pop(rid, None)
        fresh = []
        for rid, fields in loads.items():  # the common case at fleet scale: only loads moved
            i = self.position.get(rid)
            old = self.states[i] if i is not None else None
            load = entry_load(fields, rid, old.info.generation, self.signer) if old is not None else None
            if load is None:  # unknown replica, another generation, not verifying: read the record
                reads.add(rid)
            else:
                fresh.append(ReplicaState(old.info, load))
        if fresh:
            self._replace(fresh)

    def _replace(self, fresh: list[ReplicaState]) -> None:
        """New records of replicas already known, none joining or leaving: each takes its predecessor's
        place, so the positions stand and the work is O(changes) besides one C-speed copy of each table
        (not a rebuild of them from the fleet's records, which at 1,000 replicas took a millisecond of the
        event loop four times a second)."""
        states, by_generation = list(self.states), self.by_generation
        catalog_changed = False
        for s in fresh:
            rid = s.info.replica_id
            old = states[self.position[rid]]
            states[self.position[rid]] = s
            if old.info.generation != s.info.generation:
                if by_generation is self.by_generation:  # copied only when a generation moves
                    by_generation = dict(by_generation)
                if by_generation.get(old.info.generation) == rid:
                    del by_generation[old.info.generation]
                if s.info.generation:
                    by_generation[s.info.generation] = rid
            if old.info is not s.info:
                key = s.info.catalog_key()
                catalog_changed = catalog_changed or self._catalog[rid][1] != key
                self._catalog[rid] = (s.info, key)
        self.states, self.by_generation = states, by_generation
        self.journal.swapped(frozenset(s.info.replica_id for s in fresh))
        if catalog_changed:  # after the swap, as in _install
            self.catalog_version += 1
        self.read_at = time.monotonic()

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` after each swap of the records (weakly held when it is a bound method)."""
        self.journal.watch(callback)

    @property
    def version(self) -> int:
        return self.journal.version

    def changed_since(self, version: int) -> list[ReplicaState] | None:
        """The current states of the replicas whose state changed in the swaps after `version` (one this
        reader got from `version`), or None when that is unknown (a replica joined or left, or `version` is
        older than the journal): then compare them all."""
        ids = self.journal.changed_since(version)
        if ids is None:
            return None
        states, position = self.states, self.position
        return [states[position[rid]] for rid in ids]

    async def _any_gone(self) -> bool:
        """Whether a record this router holds has expired or been removed: one EXISTS over their keys (a
        cluster client splits it by slot), whose reply is one integer, instead of every record's bytes.
        A replica that joined is not missed: its first write appends to the change stream."""
        ids = [s.info.replica_id for s in self.states]
        if not ids:
            return True
        present = 0
        for i in range(0, len(ids), EXISTS_CHUNK):
            present += await self.client.exists(*[keys.replica_key(self.ns, rid) for rid in ids[i:i + EXISTS_CHUNK]])
        return present < len(ids)

    async def _read_ids(self, ids: list[str], swap=None) -> tuple[list[ReplicaState], list[str], list[str]]:
        """(the records of `ids` that exist and verify, the ids whose record is gone, those whose record does
        not parse or verify); with `swap`, the records are handed to it PARSE_CHUNK at a time instead."""
        states, gone, rejected = [], [], []
        for i in range(0, len(ids), READ_CHUNK):
            chunk = ids[i:i + READ_CHUNK]
            raws = await self._mget([keys.replica_key(self.ns, rid) for rid in chunk])
            for j, (rid, raw) in enumerate(zip(chunk, raws, strict=True)):
                # A yield every few records: at 1,000 replicas one read must not hold the event loop (and
                # every decision waiting on it) for the whole parse, nor pay a round trip per few records.
                if j and j % PARSE_CHUNK == 0:
                    if swap is not None and states:
                        swap(states)
                        states = []
                    await self._between_chunks()
                if raw is None:
                    gone.append(rid)
                    continue
                state = self._parse(rid, raw)
                if state is not None:
                    states.append(state)
                else:
                    rejected.append(rid)
        if swap is not None and states:
            swap(states)
            states = []
        return states, gone, rejected

    def _install(self, states: list[ReplicaState]) -> None:
        # Swapped together, with no await in between: a decision reads one consistent set.
        position = {s.info.replica_id: i for i, s in enumerate(states)}
        by_generation = {s.info.generation: s.info.replica_id for s in states if s.info.generation}
        catalog_changed = self._note_catalog(states)
        self.states, self.position, self.by_generation = states, position, by_generation
        self.journal.swapped(None)
        if catalog_changed:  # after the swap: a reader that saw the new version reads the new states
            self.catalog_version += 1
        self._parsed = {rid: v for rid, v in self._parsed.items() if rid in self.position}
        self.read_at = time.monotonic()

    def _note_catalog(self, states: list[ReplicaState]) -> bool:
        """Whether the served models or adapters may differ from the last install's. An unchanged record
        parses to the same info object, so only changed ones are keyed and compared."""
        old, new, changed = self._catalog, {}, len(states) != len(self._catalog)
        for s in states:
            rid, info = s.info.replica_id, s.info
            prev = old.get(rid)
            if prev is not None and prev[0] is info:
                new[rid] = prev
                continue
            key = info.catalog_key()
            changed = changed or prev is None or prev[1] != key
            new[rid] = (info, key)
        self._catalog = new
        return changed

    async def _mget(self, names: list[str]) -> list[bytes | None]:
        # One multi-bulk reply parses far faster than as many GET replies; a cluster splits it by slot.
        if hasattr(self.client, "mget_nonatomic"):
            return await self.client.mget_nonatomic(names)
        return await self.client.mget(names)

    def _parse(self, rid: str, raw: bytes) -> ReplicaState | None:
        cached = self._parsed.get(rid)
        if cached is not None and cached[0] == raw:
            return cached[1]
        try:
            state = ReplicaState.from_json(raw, 0, self.signer)
        except (UntrustedRecord, ValueError, KeyError, TypeError) as exc:
            if rid not in self._warned and len(self._warned) < 1024:  # a forger must not flood the log
                self._warned.add(rid)
                log.warning("ignoring registry record %r: %s", rid, exc)
            return None
        self._parsed[rid] = (raw, state)
        return state

    async def _loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.refresh)
            try:
                await self.refresh_changed()
            except Exception as exc:  # the decision path notices the outage itself and degrades
                if self._closing:  # the client can turn a cancellation into an error: closing wins
                    return
                if not self._failing:
                    log.warning("registry records unreadable (%s: %s); keeping the last ones", type(exc).__name__, exc)
                self._failing = True
            else:
                self._failing = False

    async def close(self) -> None:
        if self._task is not None:
            # Awaited, so a read in flight ends here, not against a client its owner closes next (which
            # logged a false "records unreadable"); the flag ends the loop even where redis-py's pool
            # turned the cancellation into an error (it once kept the loop alive), and the wait is bounded.
            task, self._task = self._task, None
            self._closing = True
            task.cancel()
            try:
                await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), CLOSE_WAIT)
            except asyncio.TimeoutError:
                log.warning("registry records loop did not stop within %.0f s of close", CLOSE_WAIT)


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _entry_id(entry) -> str:
    return _text(entry[0])


def _newer(a: str, b: str) -> bool:
    """Whether stream id a comes after b ("ms-seq")."""
    am, _, aseq = a.partition("-")
    bm, _, bseq = b.partition("-")
    return (int(am), int(aseq or 0)) > (int(bm), int(bseq or 0))
