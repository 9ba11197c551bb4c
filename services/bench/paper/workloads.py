"""The vLLM paper's workloads, synthesized from a seed: ShareGPT-like and Alpaca-like lengths, Poisson arrivals.

The paper (Kwon et al., SOSP 2023, section 6.1) reports mean input/output lengths of 161/338 tokens for
ShareGPT and 19.3/58.5 for Alpaca, a maximum sequence length of 2048, and (Table 1) 15.7K KV slots for
OPT-13B on one A100-40GB: a pool of 7.7 maximum-length sequences. Lengths here are log-normal with those
means (ShareGPT's long tail wider than Alpaca's), multiplied by a per-workload scale so a run fits a
small CPU; the maximum sequence length and the pool scale with them, so every ratio that decides how
many requests fit (pool / max length, length / max length) stays the paper's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PAPER_MAX_SEQ_LEN = 2048
PAPER_POOL_IN_MAX_SEQS = 15.7e3 / PAPER_MAX_SEQ_LEN  # OPT-13B on an A100-40GB: 15.7K slots


@dataclass(frozen=True)
class LengthDistribution:
    name: str
    mean_input: float  # tokens, at scale 1 (the paper's figure)
    mean_output: float
    sigma_input: float  # log-normal shape: larger is a longer tail
    sigma_output: float


SHAREGPT = LengthDistribution("sharegpt", 161.0, 338.0, 1.0, 0.9)
ALPACA = LengthDistribution("alpaca", 19.3, 58.5, 0.6, 0.8)
DISTRIBUTIONS = {d.name: d for d in (SHAREGPT, ALPACA)}


@dataclass(frozen=True)
class WorkloadScale:
    """One workload scaled down: its lengths, maximum sequence length and KV pool shrink together."""

    dist: LengthDistribution
    scale: float

    @property
    def max_seq_len(self) -> int:
        return max(16, round(PAPER_MAX_SEQ_LEN * self.scale))

    def pool_blocks(self, block_size: int) -> int:
        return math.ceil(PAPER_POOL_IN_MAX_SEQS * self.max_seq_len / block_size)


@dataclass
class TraceRequest:
    request_id: str
    arrival: float  # seconds after the trace starts
    prompt_token_ids: list[int]
    output_len: int


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)  # a log-normal with this mean


def sample_lengths(w: WorkloadScale, rng: random.Random) -> tuple[int, int]:
    """(input, output) tokens, each at least 1, their sum within the maximum sequence length."""
    d, cap = w.dist, w.max_seq_len
    n_in = min(cap - 1, max(1, round(_lognormal(rng, d.mean_input * w.scale, d.sigma_input))))
    n_out = min(cap - n_in, max(1, round(_lognormal(rng, d.mean_output * w.scale, d.sigma_output))))
    return n_in, n_out


def poisson_trace(w: WorkloadScale, num_requests: int, rate: float, vocab_size: int, seed: int,
                  tag: str = "") -> list[TraceRequest]:
    """`num_requests` requests arriving as a Poisson process of `rate` per second (inf: all at time 0).
    The lengths depend on the seed alone, so every rate and system serves the same requests."""
    lengths_rng, arrivals_rng = random.Random(seed), random.Random(seed + 1)
    t, trace = 0.0, []
    for i in range(num_requests):
        n_in, n_out = sample_lengths(w, lengths_rng)
        # Random ids above the special tokens: prompts share no prefix, so no cache hit helps anyone.
        prompt = [lengths_rng.randrange(100, vocab_size) for _ in range(n_in)]
        trace.append(TraceRequest(f"{tag}{w.dist.name}-{i}", t, prompt, n_out))
        if math.isfinite(rate):
            t += arrivals_rng.expovariate(rate)
    return trace
