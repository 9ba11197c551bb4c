"""The serving systems the scheduler can be: pagedserve and the baselines of the Orca and vLLM papers.

Each is the same scheduler and block pool configured with an allocator (paged blocks, or one contiguous
reservation per request sized by a `Reservation` policy) and an admission policy (`Batching`):

| system | allocator | admission |
|---|---|---|
| `pagedserve` | paged blocks on demand, shared by prefix and forks | iteration-level |
| `orca-oracle` | contiguous: prompt + true output length | iteration-level |
| `orca-pow2` | contiguous: prompt + next power of two of the output length | iteration-level |
| `orca-max` | contiguous: the maximum sequence length | iteration-level |
| `request-level` | contiguous: the maximum sequence length | request-level (static batches) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.batching import Batching
from services.scheduler.block_pool import BlockPool, KVEvent
from services.scheduler.contiguous_kv import ContiguousKVManager, Reservation
from services.scheduler.kv_cache_manager import KVCacheManager


@dataclass(frozen=True)
class ServingSystem:
    name: str
    reservation: Reservation | None  # None: paged blocks
    batching: Batching

    def build_kv(self, num_blocks: int, block_size: int, hash_seed: int, max_model_len: int,
                 enable_prefix_caching: bool, on_event: Callable[[KVEvent], None] | None,
                 group_windows: list[int | None] | None = None):
        """The block pool and the KV manager over it. `group_windows`: the engine's KV groups (None: full
        attention), one table per group per sequence."""
        groups = group_windows or [None]
        if self.reservation is None:
            pool = BlockPool(num_blocks, enable_prefix_caching, on_event=on_event)
            return pool, KVCacheManager(pool, block_size, hash_seed, watermark_blocks=max(1, num_blocks // 100),
                                        group_windows=groups)
        if groups != [None]:
            raise ValueError(f"the {self.name} baseline reserves one contiguous run per request for one KV group; "
                             f"this model has {len(groups)} (sliding-window layers): serve it as pagedserve")
        pool = BlockPool(num_blocks, enable_caching=False)
        return pool, ContiguousKVManager(pool, block_size, self.reservation, max_model_len)


SYSTEMS = {s.name: s for s in (
    ServingSystem("pagedserve", None, Batching.ITERATION),
    ServingSystem("orca-oracle", Reservation.ORACLE, Batching.ITERATION),
    ServingSystem("orca-pow2", Reservation.POW2, Batching.ITERATION),
    ServingSystem("orca-max", Reservation.MAX, Batching.ITERATION),
    ServingSystem("request-level", Reservation.MAX, Batching.REQUEST),
)}


def serving_system(name: str) -> ServingSystem:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown serving system {name!r}: one of {', '.join(SYSTEMS)}") from None
