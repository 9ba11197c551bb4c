"""How a model's layers share the paged KV cache: KV groups (vLLM's hybrid allocator, uniform pages).

Layers that attend alike (full attention, or one sliding window) form groups of `group_size` layers
each; every group has its own block table per sequence, and all groups draw their blocks from one pool.
A block id is one page of `group_size` layers: the cache is one arena `[group_size, 2, num_blocks,
block_size, kv_heads, head_dim]`, and layer i reads and writes slot `layer_slot[i]` of it through the
tables of group `layer_group[i]`. Since a block belongs to one group's tables at a time, layers of
different groups sharing a slot never meet in the same block.

`group_size` is the smallest number of layers of one kind (vLLM's rule): a model with 15 sliding and
3 full layers gets 5 sliding groups and 1 full group of 3 layers; a kind whose count it does not
divide leaves the last group's spare slots unused (memory, never a wrong read). A model without
windows is one group of all its layers: the cache and the tables are exactly the Llama-only ones.

Sliding groups need only the blocks their window still sees: the scheduler frees the rest as a
sequence advances (services/scheduler/kv_cache_manager.py), so a long request holds a fraction of
full attention's blocks on those layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupPlan:
    group_size: int  # layers one block holds: the arena's first dimension
    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: the group whose tables it reads
    layer_slot: tuple[int, ...]  # per layer: its slot of the arena

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def wire_windows(self) -> list[int]:
        """The groups' windows as the handshake carries them (0: full attention)."""
        return [w or 0 for w in self.windows]


def plan_kv_groups(layer_windows: list[int | None]) -> KVGroupPlan:
    """Group layers by window: full-attention groups first (group 0 is the one the prefix index follows
    when there is one), then each window in increasing order."""
    assert layer_windows, "a model has at least one layer"
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    size = min(len(layers) for layers in kinds.values())
    windows, layer_group, layer_slot = [], [0] * len(layer_windows), [0] * len(layer_windows)
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(w)
    return KVGroupPlan(size, tuple(windows), tuple(layer_group), tuple(layer_slot))
