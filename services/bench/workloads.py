"""The benchmark workloads W1-W3: seeded random token-id prompts with fixed output lengths, EOS ignored."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Skip the first ids: special tokens would change the meaning of a "random" prompt.
    return [rng.randrange(100, vocab) for _ in range(n)]


def make_workload(name: str, vocab_size: int, seed: int = 0, scale: float = 1.0) -> list[BenchRequest]:
    rng = random.Random(seed)
    name = name.lower()
    if name == "w1":
        return [BenchRequest(_tokens(rng, 128, vocab_size), 128) for _ in range(max(1, round(64 * scale)))]
    if name == "w2":
        return [BenchRequest(_tokens(rng, rng.randint(32, 512), vocab_size), rng.randint(16, 256))
                for _ in range(max(1, round(128 * scale)))]
    if name == "w3":
        reqs = []
        for _ in range(max(1, round(8 * scale))):
            prefix = _tokens(rng, 384, vocab_size)
            reqs += [BenchRequest(prefix + _tokens(rng, 64, vocab_size), 64) for _ in range(12)]
        rng.shuffle(reqs)
        return reqs
    raise ValueError(f"unknown workload {name!r}: w1, w2 or w3")
