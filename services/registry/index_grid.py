"""Which positions of a block chain the prefix index files: every one of the first DENSE, then every STRIDE-th.

A scheduler's KV events name every block it stores or evicts with its position in the chain; its publisher
files only the positions here (services.registry.publisher), and routers search only these (RedisIndex,
MemoryIndex), claims included. Why: an H200 replica stores and evicts about 2,000 blocks a second, so a
fleet of 1,000 writes 2,000,000 index entries a second if it files them all. Filing one block in STRIDE
cuts the fleet's writes, the index's keys and a decision's probes about STRIDE-fold. A replica's cached
set is prefix-closed along each chain (its engine evicts a sequence's tail before its prefix), so the
deepest filed position a replica holds still tells its cached prefix: exactly for the first DENSE blocks
(short prompts), to within STRIDE - 1 blocks beyond.
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE = 8
STRIDE = 8


@dataclass(frozen=True)
class IndexGrid:
    """Every position below `dense`, then every `stride`-th. The publisher and the router must use the same
    one; GRID is the system's. `IndexGrid(dense=EXACT_DENSE, stride=1)` files every block (what `bench
    index` compares the stride's routing against)."""

    dense: int = DENSE
    stride: int = STRIDE

    def filed(self, position: int) -> bool:
        return position < self.dense or position % self.stride == self.stride - 1

    def filed_positions(self, start: int, end: int) -> list[int]:
        """The filed positions p with start <= p < end, ascending."""
        dense = list(range(max(0, start), min(end, self.dense)))
        first = max(start, self.dense)
        first += (self.stride - 1 - first % self.stride) % self.stride
        return dense + [p for p in range(first, end, self.stride) if p >= self.dense]


GRID = IndexGrid()
EXACT = IndexGrid(dense=1 << 20, stride=1)


def filed(position: int) -> bool:
    return GRID.filed(position)


def filed_positions(start: int, end: int) -> list[int]:
    """The filed positions p with start <= p < end, ascending."""
    return GRID.filed_positions(start, end)
