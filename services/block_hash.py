"""Chained hashes of full KV blocks: the identity of a prefix, shared by schedulers and routers.

`hash_i = H(hash_{i-1}, tokens of block i)`, seeded per model, with xxh3 (stable across processes and
machines, unlike Python's `hash()`), so a router can compute the very keys a scheduler publishes.
Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_MASK64 = (1 << 64) - 1


def model_hash_seed(model_id: str, block_size: int) -> int:
    """Root of every chain: different models (or block sizes) never share a block identity."""
    return xxhash.xxh3_64_intdigest(f"pagedserve:{model_id}:{block_size}".encode())


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (or the model seed)."""
    payload = (parent_hash & _MASK64).to_bytes(8, "little") + array("I", token_ids).tobytes()
    return xxhash.xxh3_64_intdigest(payload)


def hash_blocks(token_ids: Sequence[int], block_size: int, seed: int, start_block: int = 0,
                parent_hash: int | None = None, num_blocks: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on (up to `num_blocks` blocks in
    all); `parent_hash` is the hash of block `start_block - 1` when starting mid-chain."""
    parent = seed if parent_hash is None else parent_hash
    out: list[int] = []
    n_full = len(token_ids) // block_size
    if num_blocks is not None:
        n_full = min(n_full, num_blocks)
    for i in range(start_block, n_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
