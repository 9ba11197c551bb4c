"""Per-sequence block tables on top of the block pool: prefix hits, growth, copy-on-write, release, and
the hybrid allocation of models with sliding-window layers.

Writes only ever go to a block that its writer holds alone: full hashed blocks are immutable, and a
partial block shared after a fork is copied (copy-on-write) before the first write.

KV groups (EngineInfo.kv_group_windows; services/engine/kv_groups.py): each group has its own table
per sequence, all from one pool. A full-attention group keeps every block. A sliding-window group of
window W keeps only the blocks a next token can still see: once a sequence has computed C tokens, the
next one (at position C) sees positions C - W + 1 .. C, so blocks wholly before C - W + 1 go back to
the pool at once (after each step's commit, and before each allocation), still hashed, so later
requests can reuse them. Their table entries become None (block id `NULL_BLOCK_ID` on the wire, never
read by a windowed kernel). Admission and preemption count blocks this way, so a long request on a
sliding-window model costs a fraction of full attention's memory.

Prefix caching stays exact: a cached prefix of P tokens is reused only where every group still holds
what the continuation needs — every block for full groups, the blocks covering positions
P - W + 1 .. P - 1 for a window W — found by shrinking P until all groups agree (vLLM's hybrid
allocator does the same).
"""

from __future__ import annotations

from services.contracts.block_hash import hash_blocks
from services.scheduler.block_pool import BlockPool, KVBlock
from services.scheduler.sequence import Sequence

NULL_BLOCK_ID = 0  # a sliding group's table entry for a block its window no longer sees (never read)

Column = tuple  # one block index of a prefix hit: per group its KVBlock, or None where no longer needed


class KVCacheManager:
    supports_sharing = True

    def __init__(self, pool: BlockPool, block_size: int, hash_seed: int, watermark_blocks: int = 0,
                 group_windows: list[int | None] | None = None):
        self.pool = pool
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.watermark_blocks = watermark_blocks
        self.windows: list[int | None] = list(group_windows or [None])
        self.num_groups = len(self.windows)
        self.sliding = [g for g, w in enumerate(self.windows) if w is not None]
        # Group 0's tables (what single-group callers read) and groups 1.. beside them.
        self.tables: dict[str, list[KVBlock | None]] = {}
        self.block_ids: dict[str, list[int]] = {}  # same tables as plain ints, shared with SchedulerOutput
        self.group_tables: dict[str, list[list[KVBlock | None]]] = {}
        self.group_block_ids: dict[str, list[list[int]]] = {}
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

    # -- windows ----------------------------------------------------------------------------
    def first_needed_block(self, group: int, num_computed: int) -> int:
        """The first block a sequence with `num_computed` tokens still needs in `group`."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, (num_computed - window + 1) // self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once when computed in chunks of at most
        `chunk` tokens: every block in a full group, in a sliding group its window plus a chunk."""
        bs = self.block_size
        total = -(-num_tokens // bs)
        return sum(total if w is None else min(total, -(-(w - 1 + min(chunk, num_tokens)) // bs) + 1)
                   for w in self.windows)

    def _all_tables(self, seq_id: str) -> list[list[KVBlock | None]]:
        return [self.tables[seq_id], *self.group_tables[seq_id]]

    def _all_ids(self, seq_id: str) -> list[list[int]]:
        return [self.block_ids[seq_id], *self.group_block_ids[seq_id]]

    def _release_skipped(self, req: Sequence) -> None:
        """Free every sliding-group block that no later token of `req` can see."""
        if req.seq_id not in self.tables:
            return
        tables, ids = self._all_tables(req.seq_id), self._all_ids(req.seq_id)
        for g in self.sliding:
            table, row = tables[g], ids[g]
            for i in range(min(self.first_needed_block(g, req.num_computed_tokens), len(table)) - 1, -1, -1):
                block = table[i]
                if block is None:
                    break  # everything before it was released earlier
                table[i], row[i] = None, NULL_BLOCK_ID
                self.pool.free(block)

    # -- admission --------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, params) -> None:
        """Paged blocks fit any request the pool can hold at all, which the core checks: nothing to add."""

    def find_cached_prefix(self, req: Sequence) -> list[Column]:
        """Longest run of cached full blocks at the start of `req` that every group can continue from,
        leaving at least one token to compute: one column per block."""
        if not self.pool.enable_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        self._extend_hashes(req, max_blocks * bs)
        hashes = req.block_hashes[:max_blocks]
        lookup = self.pool.lookup
        found: list[list[KVBlock | None]] = [[] for _ in range(self.num_groups)]
        n = max_blocks
        for g, w in enumerate(self.windows):
            if w is None:  # a full group's hit ends at its first miss: no lookups past it
                for h in hashes[:n]:
                    block = lookup(h, g)
                    if block is None:
                        break
                    found[g].append(block)
                n = len(found[g])
        for g in self.sliding:
            found[g] = [lookup(h, g) for h in hashes[:n]]
        while True:  # shrink until every sliding group holds its window before the hit's end
            agreed = n
            for g in self.sliding:
                n = self._sliding_hit(g, found[g], n)
            if n == agreed:
                break
        return [tuple(found[g][i] if i >= self.first_needed_block(g, n * bs) else None
                      for g in range(self.num_groups)) for i in range(n)]

    def _sliding_hit(self, group: int, found: list[KVBlock | None], limit: int) -> int:
        """The largest n <= limit whose blocks from first_needed_block(n * block_size) to n are all cached."""
        run = 0  # cached blocks ending at index i
        runs = []
        for i in range(limit):
            run = run + 1 if found[i] is not None else 0
            runs.append(run)
        for n in range(limit, 0, -1):
            if runs[n - 1] >= n - self.first_needed_block(group, n * self.block_size):
                return n
        return 0

    def allocate_slots(self, req: Sequence, num_new_tokens: int, cached: list[Column] | None = None,
                       watermark: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens of `req`; all-or-nothing. Returns False when short."""
        if self.num_groups == 1 and not self.sliding:
            return self._allocate_one_table(req, num_new_tokens, cached, watermark)
        return self._allocate_groups(req, num_new_tokens, cached, watermark)

    def _allocate_one_table(self, req: Sequence, num_new_tokens: int, cached: list[Column] | None,
                            watermark: bool) -> bool:
        """One full-attention group (no windows): the scheduler's hot path, kept to the plain table."""
        table = self.tables.get(req.seq_id)
        bs = self.block_size
        if table is None:
            hits = [col[0] for col in cached or ()]
            need_touch_free = sum(1 for b in hits if b.ref_cnt == 0)
            have_blocks, start, cow = len(hits), len(hits) * bs, False
        else:
            need_touch_free, have_blocks, start = 0, len(table), req.num_computed_tokens
            # A partially filled, shared last block must be copied before we write into it.
            cow = start % bs != 0 and table[start // bs].ref_cnt > 1
        new_blocks = max(0, (start + num_new_tokens + bs - 1) // bs - have_blocks)
        reserve = self.watermark_blocks if watermark else 0
        if new_blocks + need_touch_free + int(cow) + reserve > self.pool.num_free:
            return False
        if table is None:
            for b in hits:
                self.pool.touch(b)
            table = self.tables[req.seq_id] = hits
            self.block_ids[req.seq_id] = [b.block_id for b in hits]
            self.group_tables[req.seq_id], self.group_block_ids[req.seq_id] = [], []
        self._grow(table, self.block_ids[req.seq_id], 0, start, new_blocks, cow)
        return True

    def _allocate_groups(self, req: Sequence, num_new_tokens: int, cached: list[Column] | None,
                         watermark: bool) -> bool:
        seq_id = req.seq_id
        bs = self.block_size
        new_seq = seq_id not in self.tables
        if new_seq:
            cached = cached or []
            hit = {id(b): b for col in cached for b in col if b is not None}
            need_touch_free = sum(1 for b in hit.values() if b.ref_cnt == 0)
            have = [len(cached)] * self.num_groups
            start = len(cached) * bs
            cow = [False] * self.num_groups
        else:
            self._release_skipped(req)
            tables = self._all_tables(seq_id)
            need_touch_free = 0
            have = [len(t) for t in tables]
            start = req.num_computed_tokens
            cow = [start % bs != 0 and t[start // bs] is not None and t[start // bs].ref_cnt > 1 for t in tables]
        total_blocks = (start + num_new_tokens + bs - 1) // bs
        new_blocks = [max(0, total_blocks - h) for h in have]
        reserve = self.watermark_blocks if watermark else 0
        if sum(new_blocks) + need_touch_free + sum(cow) + reserve > self.pool.num_free:
            return False
        if new_seq:
            for b in hit.values():
                self.pool.touch(b)
            tables = [[col[g] for col in cached] for g in range(self.num_groups)]
            ids = [[NULL_BLOCK_ID if b is None else b.block_id for b in t] for t in tables]
            self.tables[seq_id], self.group_tables[seq_id] = tables[0], tables[1:]
            self.block_ids[seq_id], self.group_block_ids[seq_id] = ids[0], ids[1:]
        for g, (table, row) in enumerate(zip(self._all_tables(seq_id), self._all_ids(seq_id), strict=True)):
            self._grow(table, row, g, start, new_blocks[g], cow[g])
        return True

    def _grow(self, table: list, row: list[int], group: int, start: int, new_blocks: int, cow: bool) -> None:
        """Copy-on-write of the block `start` falls in (when `cow`), then `new_blocks` fresh blocks."""
        if cow:
            i = start // self.block_size
            src = table[i]
            dst = self.pool.allocate(group)
            self.pending_copies.append((src.block_id, dst.block_id))
            self.pool.free(src)
            table[i], row[i] = dst, dst.block_id
        for _ in range(new_blocks):
            b = self.pool.allocate(group)
            table.append(b)
            row.append(b.block_id)

    def record_hit(self, req: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_hit_tokens

    # -- after a step -----------------------------------------------------------------------
    def commit(self, req: Sequence) -> None:
        """Register the full blocks `req` has now computed, so later requests can reuse them; then give
        back the blocks its sliding windows have left behind."""
        if self.pool.enable_caching:
            n_full = req.num_computed_tokens // self.block_size
            self._extend_hashes(req, n_full * self.block_size)
            hashes, register = req.block_hashes, self.pool.register
            tables = (self.tables[req.seq_id],) if self.num_groups == 1 else self._all_tables(req.seq_id)
            for table in tables:
                for i in range(n_full - 1, -1, -1):
                    block = table[i]
                    if block is None or block.block_hash is not None:
                        break  # everything before it was registered (or released) earlier
                    register(block, hashes[i], i)
        if self.sliding:
            self._release_skipped(req)

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
        tables = self._all_tables(parent.seq_id)
        for table in tables:
            for b in table:
                if b is not None:
                    self.pool.touch(b)
        copies = [list(t) for t in tables]
        self.tables[child.seq_id], self.group_tables[child.seq_id] = copies[0], copies[1:]
        ids = [list(row) for row in self._all_ids(parent.seq_id)]
        self.block_ids[child.seq_id], self.group_block_ids[child.seq_id] = ids[0], ids[1:]

    def free(self, req: Sequence) -> None:
        seq_id = req.seq_id
        table = self.tables.pop(seq_id, None)
        groups = self.group_tables.pop(seq_id, [])
        self.block_ids.pop(seq_id, None)
        self.group_block_ids.pop(seq_id, None)
        for t in ([table] if table else []) + groups:
            # Tail first, so a sequence's last blocks are evicted before its (more shareable) prefix.
            for b in reversed(t):
                if b is not None:
                    self.pool.free(b)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_held(self, seq_id: str) -> int:
        """Blocks `seq_id`'s tables hold now, every group counted."""
        return sum(1 for t in self._all_tables(seq_id) for b in t if b is not None)

    def num_blocks_unshared(self) -> int:
        """Blocks the current tables would hold if no block were shared (n > 1 forks, beams, prefix hits);
        `pool.num_in_use` is what they hold: the difference is what sharing saves now."""
        return sum(self.num_blocks_held(s) for s in self.tables)
