"""Per-sequence block tables on top of the block pool: prefix hits, growth, copy-on-write, release.

Writes only ever go to a block that its writer holds alone: full hashed blocks are immutable, and a
partial block shared after a fork is copied (copy-on-write) before the first write.
"""

from __future__ import annotations

from services.contracts.block_hash import hash_blocks
from services.scheduler.block_pool import BlockPool, KVBlock
from services.scheduler.sequence import Sequence


class KVCacheManager:
    supports_sharing = True

    def __init__(self, pool: BlockPool, block_size: int, hash_seed: int, watermark_blocks: int = 0):
        self.pool = pool
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.watermark_blocks = watermark_blocks
        self.tables: dict[str, list[KVBlock]] = {}
        self.block_ids: dict[str, list[int]] = {}  # same tables as plain ints, shared with SchedulerOutput
        self.pending_copies: list[tuple[int, int]] = []
        # Prefix-cache counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- hashing ----------------------------------------------------------------------------
    def _extend_hashes(self, req: Sequence, upto_tokens: int) -> None:
        hashes = req.block_hashes
        root = self.hash_seed if req.hash_root is None else req.hash_root
        hashes += hash_blocks(req.token_ids, self.block_size, root, start_block=len(hashes),
                              parent_hash=hashes[-1] if hashes else None, num_blocks=upto_tokens // self.block_size)

    # -- admission --------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params) -> None:
        """Paged blocks fit any request the pool can hold at all, which the core checks: nothing to add."""

    def find_cached_prefix(self, req: Sequence) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of `req`, leaving at least one token to compute."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks * self.block_size)
        hits: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, req: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None,
                       watermark: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens of `req`; all-or-nothing. Returns False when short."""
        table = self.tables.get(req.seq_id)
        bs = self.block_size
        if table is None:
            table = []
            cached = cached or []
            need_touch_free = sum(1 for b in cached if b.ref_cnt == 0)
            have_blocks = len(cached)
            start = len(cached) * bs
        else:
            need_touch_free = 0
            have_blocks = len(table)
            start = req.num_computed_tokens
        total_blocks = (start + num_new_tokens + bs - 1) // bs
        new_blocks = max(0, total_blocks - have_blocks)
        # A partially filled, shared last block must be copied before we write into it.
        cow = bool(table) and start % bs != 0 and table[start // bs].ref_cnt > 1
        needed = new_blocks + need_touch_free + int(cow)
        reserve = self.watermark_blocks if watermark else 0
        if needed + reserve > self.pool.num_free:
            return False
        if req.seq_id not in self.tables:
            for b in cached:
                self.pool.touch(b)
            table = list(cached)
            self.tables[req.seq_id] = table
            self.block_ids[req.seq_id] = [b.block_id for b in table]
        ids = self.block_ids[req.seq_id]
        if cow:
            i = start // bs
            src = table[i]
            dst = self.pool.allocate()
            self.pending_copies.append((src.block_id, dst.block_id))
            self.pool.free(src)
            table[i] = dst
            ids[i] = dst.block_id
        for _ in range(new_blocks):
            b = self.pool.allocate()
            table.append(b)
            ids.append(b.block_id)
        return True

    def record_hit(self, req: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_hit_tokens

    # -- after a step -----------------------------------------------------------------------
    def commit(self, req: Sequence) -> None:
        """Register the full blocks `req` has now computed, so later requests can reuse them."""
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        n_full = req.num_computed_tokens // bs
        table = self.tables[req.seq_id]
        self._extend_hashes(req, n_full * bs)
        for i in range(n_full - 1, -1, -1):
            if table[i].block_hash is not None:
                break  # everything before it was registered earlier
            self.pool.register(table[i], req.block_hashes[i], i)

    def trim(self, req: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` positions: rejected draft tokens' and the slots a
        drafter wrote ahead into. They hold nothing committed, so none was ever hashed."""
        table = self.tables.get(req.seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        ids = self.block_ids[req.seq_id]
        while len(table) > keep:
            block = table.pop()
            ids.pop()
            assert block.block_hash is None or self.pool.cached.get(block.block_hash) is not block, block
            self.pool.free(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.tables[parent.seq_id]
        for b in table:
            self.pool.touch(b)
        self.tables[child.seq_id] = list(table)
        self.block_ids[child.seq_id] = [b.block_id for b in table]

    def free(self, req: Sequence) -> None:
        table = self.tables.pop(req.seq_id, None)
        self.block_ids.pop(req.seq_id, None)
        if table:
            # Tail first, so a sequence's last blocks are evicted before its (more shareable) prefix.
            for b in reversed(table):
                self.pool.free(b)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_unshared(self) -> int:
        """Blocks the current tables would hold if no block were shared (n > 1 forks, beams, prefix hits);
        `pool.num_in_use` is what they hold: the difference is what sharing saves now."""
        return sum(len(t) for t in self.tables.values())
