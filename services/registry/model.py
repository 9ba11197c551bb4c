"""What the registry knows about a model replica, as it crosses from schedulers to routers.

One record per replica holds its identity and its latest load, so a router reads both in one lookup.
Block hashes are 64-bit unsigned ints (services.contracts.block_hash); in Redis they are decimal strings.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """How a replica's scheduler identifies its model's prefix blocks (decided once, from its engine's
    handshake, and learned by routers from the registry: they never guess it)."""

    model: str  # served model name
    block_size: int
    hash_seed: int


@dataclass(slots=True)
class ReplicaInfo:
    replica_id: str
    url: str  # where routers send HTTP requests, e.g. http://10.0.0.7:8100
    model: str  # served model name
    block_size: int
    max_model_len: int
    capacity: int  # requests it runs at once (max_num_seqs): the scale of its load figures
    hash_seed: int  # root of its block-hash chains (services.contracts.block_hash.model_hash_seed of its engine)
    # The id its blocks are filed under in the prefix index (services.registry.keys): a new random one at
    # each full resync, so the entries of an old generation, or of a dead replica, simply stop counting.
    generation: int = 0
    adapters: dict[str, str] = field(default_factory=dict)  # resident LoRA adapters: name -> adapter_digest
    # SHA-256 of its tokenizer bundle (services.model_files.tokenizer.read_bundle), published under this digest in the
    # registry: routers fetch a model's tokenizer and chat template from there and verify them by it.
    tokenizer_digest: str = ""
    # Seconds this replica took to make an adapter resident (its last load; 0: none measured yet): what
    # routing an adapter's request to a replica where it is not resident costs.
    adapter_load_seconds: float = 0.0
    # How its engine runs the model: "pagedserve" (a family module) or "transformers" (transformers' own class).
    model_path: str = "pagedserve"

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.model, self.block_size, self.hash_seed)

    def catalog_key(self) -> tuple:
        """What routers derive the served models and adapters from (not load, not cached blocks): when no
        replica's key changes, and none joins or leaves, what a model name resolves to stays the same."""
        return (self.generation, self.model, self.block_size, self.hash_seed, self.max_model_len,
                self.tokenizer_digest, tuple(sorted(self.adapters.items())))


@dataclass(slots=True)
class ReplicaLoad:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    healthy: bool = True  # False while its engine is down: routers skip it
    cached_blocks: int = 0  # size of its block set: where new prefixes fit best

    @property
    def requests(self) -> int:
        return self.num_waiting + self.num_running

    def to_compact(self) -> str:
        """The load as the change stream carries it beside a replica's id ("waiting,running,kv,healthy,
        cached"): a router applies it without reading and parsing the whole record."""
        return f"{self.num_waiting},{self.num_running},{self.kv_usage!r},{int(self.healthy)},{self.cached_blocks}"

    @classmethod
    def from_compact(cls, text: str) -> ReplicaLoad:
        """Raises ValueError on anything to_compact did not write (a negative count, a non-finite usage)."""
        waiting, running, kv, healthy, cached = text.split(",")
        load = cls(int(waiting), int(running), float(kv), healthy == "1", int(cached))
        if min(load.num_waiting, load.num_running, load.cached_blocks) < 0 or not math.isfinite(load.kv_usage) \
                or healthy not in ("0", "1"):
            raise ValueError(f"not a load: {text!r}")
        return load


@dataclass(slots=True)
class ReplicaState:
    """A live replica as one routing decision sees it."""

    info: ReplicaInfo
    load: ReplicaLoad
    matched_blocks: int = 0  # leading blocks of the prompt at hand that it caches (or has claimed)

    def to_json(self, signer: Signer | None = None) -> str:
        """The record as stored; with a signer (the internal token) it carries an HMAC of its content."""
        d: dict = {"info": asdict(self.info), "load": asdict(self.load)}
        if signer is not None:
            d["sig"] = signer.sign(_canonical(d))
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, matched_blocks: int = 0, signer: Signer | None = None) -> ReplicaState:
        """Raises UntrustedRecord when a signer is given and the record's signature does not verify."""
        d = json.loads(text)
        if signer is not None and not signer.verify(_canonical({"info": d["info"], "load": d["load"]}),
                                                    d.get("sig")):
            raise UntrustedRecord(f"registry record of {d.get('info', {}).get('replica_id')!r} is not signed "
                                  "with this cluster's internal token")
        return cls(ReplicaInfo(**d["info"]), ReplicaLoad(**d["load"]), matched_blocks)


def split_holders(states: list[ReplicaState]) -> tuple[list[ReplicaState], list[ReplicaState]]:
    """A snapshot as (every replica with matches 0, the ones that matched): the form routers rank from."""
    holders = [s for s in states if s.matched_blocks]
    if holders:
        states = [ReplicaState(s.info, s.load, 0) if s.matched_blocks else s for s in states]
    return states, holders


def with_holders(states: list[ReplicaState], holders: list[ReplicaState]) -> list[ReplicaState]:
    """The snapshot split_holders split: every replica, the holders with their matches."""
    if not holders:
        return list(states)
    by_id = {h.info.replica_id: h for h in holders}
    return [by_id.get(s.info.replica_id, s) for s in states]


class UntrustedRecord(ValueError):
    """A registry record nobody holding the internal token wrote: routers ignore it."""


class Signer(Protocol):
    def sign(self, payload: bytes) -> str: ...

    def verify(self, payload: bytes, signature: str | None) -> bool: ...


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


@dataclass(slots=True)
class BlockDelta:
    """Net change to one replica's cached-block set since the last publish (disjoint sets)."""

    stored: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)


class RegistrySink(Protocol):
    """Where a scheduler writes (Redis, or the in-memory index of `pagedserve serve`)."""

    async def write_state(self, state: ReplicaState, ttl: float) -> None: ...

    async def write_blocks(self, replica_id: str, delta: BlockDelta, ttl: float) -> None: ...

    async def replace_blocks(self, replica_id: str, blocks: set[int], ttl: float) -> None: ...

    async def remove_replica(self, replica_id: str) -> None: ...

    async def write_tokenizer(self, digest: str, bundle: bytes) -> None: ...


class PrefixIndex(Protocol):
    """What a router reads: every live replica with how many leading blocks of a prompt it holds.

    An index may also offer `catalog_version`, a number that changes whenever a replica joins, leaves or
    changes its ReplicaInfo.catalog_key: routers then re-derive what model names resolve to only when it
    changes, not on every decision (without it, on every read).
    """

    async def snapshot(self, block_hashes: list[int], min_blocks: int = 1) -> list[ReplicaState]:
        """Every live replica with the leading blocks it holds; a match shorter than `min_blocks` (one no
        policy would act on) may be reported as 0, which spares the index reading its many holders."""
        ...

    async def claim(self, replica_id: str, block_hashes: list[int], held: int = 0) -> None:
        """Mark a prompt's blocks from `held` on (it holds the first `held`) as about to be cached on a
        replica, so the next request with this prefix (from any router) follows it before the scheduler
        has published them."""
        ...

    async def tokenizer(self, digest: str) -> bytes | None:
        """A tokenizer bundle a replica published (services.model_files.tokenizer), by its digest."""
        ...

    async def close(self) -> None: ...
