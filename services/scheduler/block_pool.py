"""The KV block pool: every physical block, its reference count, and the prefix cache over them.

All blocks are created once. Free blocks sit in a doubly linked queue (O(1) pop, append and removal
from the middle); a freed block that holds a full, hashed block keeps its hash and stays findable by
prefix lookups until a new allocation pops it (least recently freed first). Plain Python, no torch.

Accounting: every block is exactly one of *in use* (ref_cnt > 0), *cached* (free, still hashed) or
*free* (free, empty), and in_use + cached + free == total at all times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "position", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.position = 0  # the block's index in its hash chain (meaningful while block_hash is set)
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


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
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding that content
        self.num_cached_free = 0  # blocks in the free queue that still carry a hash
        self._on_event = on_event

    # -- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (free + cached)."""
        return self.free_queue.size

    def allocate(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def take(self, block: KVBlock) -> None:
        """Allocate this particular free block: contiguous reservations choose which blocks they get."""
        assert block.ref_cnt == 0, f"{block} is in use"
        self.free_queue.remove(block)
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if self.cached.get(h) is block:
            del self.cached[h]
            if self._on_event:
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
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            self.free_queue.append(block)  # most recently used: evicted last
            self.num_cached_free += 1
        else:
            block.block_hash = None
            self.free_queue.appendleft(block)  # holds nothing reusable: hand it out first

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def register(self, block: KVBlock, block_hash: int, position: int) -> None:
        """Record that `block` (in use, just filled) holds the content with this hash, at this index of
        its chain."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another request computed the same block first; this copy stays private
        block.block_hash, block.position = block_hash, position
        self.cached[block_hash] = block
        if self._on_event:
            self._on_event(KVEvent("stored", [block_hash], [position]))

    def reset_cache(self) -> None:
        """Forget every cached-but-free block (e.g. after an engine restart lost the KV tensors)."""
        for h, block in list(self.cached.items()):
            if block.ref_cnt == 0:
                self._evict(block)
            else:
                del self.cached[h]
                block.block_hash = None
                if self._on_event:
                    self._on_event(KVEvent("removed", [h], [block.position]))

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.free_queue.size

    def usage(self) -> float:
        return self.num_in_use / self.num_blocks

    def check_invariants(self) -> None:
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        assert in_use + cached + free == self.num_blocks
        assert self.free_queue.size == cached + free, (self.free_queue.size, cached, free)
        assert self.num_cached_free == cached, (self.num_cached_free, cached)
        for h, b in self.cached.items():
            assert b.block_hash == h
        assert all(b.ref_cnt >= 0 for b in self.blocks)
