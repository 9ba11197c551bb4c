"""Chained hashes of full KV blocks: the identity of a prefix, shared by schedulers and routers.

`hash_i = SHA-256(hash_{i-1}, token ids of block i)`, rooted in a seed per model and block size, and per
cache salt. A cryptographic hash because block identity is a security boundary: a block whose hash
matches is served from cache as if it held the same tokens, so anyone who could make two different
prompts collide could poison or probe another request's context (vLLM made SHA-256 its default after
GHSA-rm76-4mrf-v9r8). Hashes are the full 256-bit digests as ints; stable across processes and
machines, unlike Python's `hash()`, so a router computes the very keys a scheduler publishes. Only full
blocks are hashed: a partial block's content is still changing.

A cache salt (vLLM's `cache_salt`) changes the root, so blocks of different salts never match: the
router can give each API key its own salt, and then no key learns from `cached_tokens` or from timing
whether another key's prompt is cached.

A LoRA adapter roots its requests' chains in the digest of its files (`adapter_seed`), the cache salt
applying on top: blocks are shared exactly between requests of the same adapter content, whatever name
it was loaded under, and an adapter reloaded with new weights starts a chain of its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_HASH_BYTES = 32


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def model_hash_seed(model_id: str, block_size: int) -> int:
    """Root of every chain: different models (or block sizes) never share a block identity."""
    return _digest(f"pagedserve:{model_id}:{block_size}".encode())


def salted_seed(seed: int, cache_salt: str | None) -> int:
    """The root of the chains of requests carrying `cache_salt` (the model's own root when there is none)."""
    if not cache_salt:
        return seed
    return _digest(seed.to_bytes(_HASH_BYTES, "big") + b"salt:" + cache_salt.encode("utf-8"))


def adapter_seed(seed: int, adapter_digest: str) -> int:
    """The root of the chains of requests for a LoRA adapter, by the digest of its files: the same
    adapter shares blocks under any name and on any replica, different weights never do."""
    return _digest(seed.to_bytes(_HASH_BYTES, "big") + b"lora:" + bytes.fromhex(adapter_digest))


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (or the chain's root)."""
    return _digest(parent_hash.to_bytes(_HASH_BYTES, "big") + array("I", token_ids).tobytes())


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
