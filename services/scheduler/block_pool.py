"""The KV block pool: every physical block, its reference count, and the prefix cache over them.

All blocks are created once. Free blocks sit in a doubly linked queue (O(1) pop, append and removal
from the middle); a freed block that holds a full, hashed block keeps its hash and stays findable by
prefix lookups until a new allocation pops it (least recently freed first). Plain Python, no torch.

KV groups (services/engine/kv_groups.py): a model with sliding-window layers gives each group of layers
its own block tables, all drawn from this one pool. A block in use or cached belongs to one group (its
`group`), and the prefix cache is keyed by (group, hash): the same content computed for two groups lives
in two blocks. Only group 0's blocks are published as KV events (the routers' prefix index follows one
group; a prefix is reused here only where every group still holds what the continuation needs).

Accounting: every block is exactly one of *in use* (ref_cnt > 0), *cached* (free, still hashed) or
*free* (free, empty), and per group: sum over groups of (in use + cached) + free == total at all times
(`counts`, `check_invariants`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "position", "group", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.group = 0  # the KV group whose tables hold it (meaningful while in use or cached)
        self.block_hash: int | None = None
        self.position = 0  # the block's index in its hash chain (meaningful while block_hash is set)
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash}, group={self.group})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; head is evicted first (least recently freed)."""

    def __init__(self, blocks: list[KVBlock]):
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.size = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        last.next = block
        block.prev, block.next = last, self._tail
        self._tail.prev = block
        self.size += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next
        self._head.next = block
        block.prev, block.next = self._head, first
        first.prev = block
        self.size += 1


@dataclass(slots=True)
class KVEvent:
    """A change to the prefix index, published to Redis so routers know what each replica holds."""

    kind: str  # "stored" or "removed"
    block_hashes: list[int]
    positions: list[int]  # each block's index in its chain: the index files only some (index_grid)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_event: Callable[[KVEvent], None] | None = None):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # block hash (group 0) or (group, hash) -> the block holding that content
        self.cached: dict[int | tuple[int, int], KVBlock] = {}
        self.num_cached_free = 0  # blocks in the free queue that still carry a hash
        self._on_event = on_event

    # -- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free + cached)."""
        return self.free_queue.size

    def allocate(self, group: int = 0) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        block.group = group
        return block

    def take(self, block: KVBlock) -> None:
        """Allocate this particular free block: contiguous reservations choose which blocks they get."""
        assert block.ref_cnt == 0, f"{block} is in use"
        self.free_queue.remove(block)
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        block.group = 0

    @staticmethod
    def _key(block_hash: int, group: int) -> int | tuple[int, int]:
        return block_hash if group == 0 else (group, block_hash)

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        key = self._key(h, block.group)
        if self.cached.get(key) is block:
            del self.cached[key]
            if self._on_event and block.group == 0:
                self._on_event(KVEvent("removed", [h], [block.position]))
        block.block_hash = None
        self.num_cached_free -= 1

    def touch(self, block: KVBlock) -> None:
        """Take one more reference, pulling the block out of the free queue if it sat there cached."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.num_cached_free -= 1
        block.ref_cnt += 1

    def free(self, block: KVBlock) -> None:
        assert block.ref_cnt > 0, f"double free of {block}"
        block.ref_cnt -= 1
        if block.ref_cnt:
            return
        if block.block_hash is not None and self.cached.get(self._key(block.block_hash, block.group)) is block:
            self.free_queue.append(block)  # most recently used: evicted last
            self.num_cached_free += 1
        else:
            block.block_hash = None
            self.free_queue.appendleft(block)  # holds nothing reusable: hand it out first

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: int, group: int = 0) -> KVBlock | None:
        return self.cached.get(self._key(block_hash, group)) if self.enable_caching else None

    def register(self, block: KVBlock, block_hash: int, position: int) -> None:
        """Record that `block` (in use, just filled) holds the content with this hash, at this index of
        its chain, for its group's layers."""
        if not self.enable_caching or block.block_hash is not None:
            return
        key = self._key(block_hash, block.group)
        if key in self.cached:
            return  # another request computed the same block first; this copy stays private
        block.block_hash, block.position = block_hash, position
        self.cached[key] = block
        if self._on_event and block.group == 0:
            self._on_event(KVEvent("stored", [block_hash], [position]))

    def reset_cache(self) -> None:
        """Forget every cached-but-free block (e.g. after an engine restart lost the KV tensors)."""
        for key, block in list(self.cached.items()):
            if block.ref_cnt == 0:
                self._evict(block)
            else:
                del self.cached[key]
                if self._on_event and block.group == 0:
                    self._on_event(KVEvent("removed", [block.block_hash], [block.position]))
                block.block_hash = None

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.free_queue.size

    def usage(self) -> float:
        return self.num_in_use / self.num_blocks

    def counts(self) -> dict:
        """Recounted from every block: {"free": n, "groups": {group: {"in_use": n, "cached": n}}}."""
        groups: dict[int, dict[str, int]] = {}
        free = 0
        for b in self.blocks:
            if b.ref_cnt == 0 and b.block_hash is None:
                free += 1
                continue
            g = groups.setdefault(b.group, {"in_use": 0, "cached": 0})
            g["in_use" if b.ref_cnt > 0 else "cached"] += 1
        return {"free": free, "groups": groups}

    def check_invariants(self) -> None:
        c = self.counts()
        in_use = sum(g["in_use"] for g in c["groups"].values())
        cached = sum(g["cached"] for g in c["groups"].values())
        free = c["free"]
        assert in_use + cached + free == self.num_blocks, (in_use, cached, free, self.num_blocks)
        assert self.free_queue.size == cached + free, (self.free_queue.size, cached, free)
        assert self.num_cached_free == cached, (self.num_cached_free, cached)
        for key, b in self.cached.items():
            assert key == self._key(b.block_hash, b.group), (key, b)
        assert all(b.ref_cnt >= 0 for b in self.blocks)
