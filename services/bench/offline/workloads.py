"""Benchmark workloads, all generated from a seed: W1-W3 (random token-id prompts with fixed output
lengths, EOS ignored) and shared-prefix chats (system prompts shared by groups of questions)."""

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


def offline_workload(name: str, vocab_size: int, seed: int = 0, scale: float = 1.0) -> list[BenchRequest]:
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


_WORDS = ("cargo manifest customs invoice pallet freight harbor vessel route schedule container tariff "
          "insurance warehouse clearance broker dock crane berth ledger audit priority express parcel "
          "courier tracking delay weather storm fuel captain crew inspection seal hazard refund claim").split()


def shared_prefix_chats(groups: int, questions: int, system_tokens: int, seed: int) -> list[tuple[int, list[dict]]]:
    """(group, chat messages) pairs, shuffled: each group's questions share one ~system_tokens system prompt."""
    rng = random.Random(seed)
    requests = []
    for g in range(groups):
        words = [rng.choice(_WORDS) for _ in range(int(system_tokens * 0.8))]  # ~1.25 tokens per word
        system = f"You are dispatcher number {g} of fleet {rng.randrange(10**6)}. House rules: " + " ".join(words)
        for q in range(questions):
            topic, parcel = rng.choice(_WORDS), rng.randrange(10**4)
            question = f"Question {q}: what should I do about the {topic} of parcel {parcel}?"
            requests.append((g, [{"role": "system", "content": system}, {"role": "user", "content": question}]))
    rng.shuffle(requests)
    return requests
