"""Where KV memory goes at the busiest moment, split as the vLLM paper's Figure 2 does; measured, not estimated.

Every step is watched; the busiest is the one with the most blocks allocated (ties: the most tokens in
the cache). What each live sequence will still write is only known when it finishes, so that step keeps
(sequence, slots it holds, tokens it has written) and is resolved at the end, against what each sequence
had written when it finished:

- token_states: slots holding a token's keys and values at that moment;
- reserved: slots held for tokens the sequence writes later;
- internal_fragmentation: slots held that the sequence never writes (an over-sized reservation, or the
  unused end of a paged sequence's last block);
- external_fragmentation: free slots in runs too short for the reservation the first waiting request
  needs (zero whenever nothing waits, and always for paged blocks, any one of which serves);

each in percent of the pool. The rest of the pool is free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryBreakdown:
    token_states: float
    reserved: float
    internal_fragmentation: float
    external_fragmentation: float
    free: float
    running: int  # sequences holding KV at that moment

    def as_dict(self) -> dict:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def external_fragmentation_blocks(core) -> int:
    """Free blocks that cannot take the reservation the head of the queue needs, because they lie in
    runs shorter than it. Paged pools have none: every block is placeable on its own."""
    kv, waiting = core.kv, core.scheduler.waiting
    if kv.supports_sharing or not waiting:
        return 0
    need = kv.reservation_blocks(waiting[0])
    return sum(n for _, n in kv.free_runs() if n < need)


class BusiestMoment:
    """Watches steps (possibly over several runs of one system) and reports the busiest one's breakdown."""

    def __init__(self) -> None:
        self._key = (-1, -1)
        self._live: list[tuple[object, int, int]] = []  # (sequence, slots held, tokens written)
        self._external_slots = 0
        self._pool_slots = 1

    def observe(self, core) -> None:
        kv, bs = core.kv, core.kv.block_size
        running = core.scheduler.running
        key = (core.pool.num_in_use, sum(s.num_computed_tokens for s in running))
        if key <= self._key:
            return
        self._key = key
        held = kv.runs if not kv.supports_sharing else kv.tables  # a reservation counts whole
        self._live = [(s, len(held.get(s.seq_id, ())) * bs, s.num_computed_tokens) for s in running]
        self._external_slots = external_fragmentation_blocks(core) * bs
        self._pool_slots = core.pool.num_blocks * bs

    def result(self) -> MemoryBreakdown:
        """Call once the sequences seen have finished (their final token counts decide the split)."""
        tokens = reserved = internal = held_total = 0
        for seq, held, written in self._live:
            final = max(written, seq.num_computed_tokens)  # what it had written when it finished
            used = min(held, final)
            tokens += written
            reserved += used - written
            internal += held - used
            held_total += held
        pct = 100.0 / self._pool_slots
        free = self._pool_slots - held_total - self._external_slots
        return MemoryBreakdown(tokens * pct, reserved * pct, internal * pct, self._external_slots * pct,
                               free * pct, len(self._live))
