"""Online-serving workloads for `pagedserve bench serve`, all generated from a seed (nothing downloaded).

- random: random token ids, prompt and output lengths fixed ("128") or ranged ("32-512");
- chat: a long-tailed length mix (log-normal prompts and answers, as chat traffic has), token ids;
- shared-prefix: groups of requests whose prompts share a long prefix (system prompts, few-shot);
- multi-turn: chat sessions whose every turn sends the whole conversation so far, the previous answers
  included, so prefix caching and session routing matter (answers come from the server at run time).

Token ids skip the lowest ids, where special tokens live: a "random" prompt must stay plain text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

_FIRST_ID = 100
_WORDS = ("harbor light keeper ledger storm tide vessel signal beacon night watch coast rock wave wind "
          "lamp oil glass tower stair rope anchor chart compass fog horn gull shore").split()


@dataclass
class Lengths:
    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """'128' (fixed) or '32-512' (uniform in the range, both ends included)."""
        lo, _, hi = str(text).partition("-")
        low, high = int(lo), int(hi or lo)
        if not 1 <= low <= high:
            raise ValueError(f"lengths must be 'N' or 'LOW-HIGH' with 1 <= LOW <= HIGH, got {text!r}")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass
class ServeRequest:
    index: int
    max_tokens: int
    prompt: list[int] | None = None  # token ids, sent to /v1/completions
    user_turns: list[str] = field(default_factory=list)  # multi-turn: one user message per turn (chat)
    session: int | None = None
    structured: bool = False  # sent with a JSON-schema constraint (bench serve --structured)


# What a --structured request is constrained to: an array too long to finish within any output length
# (so constrained requests run exactly as long as the others), of objects mixing strings, bounded
# integers and enums: the kinds of state a real JSON answer's masks go through.
STRUCTURED_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "qty", "tag"],
    "properties": {"name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999},
                   "tag": {"enum": ["red", "green", "blue"]}}}}


def mark_structured(requests: list[ServeRequest], share: float, seed: int) -> None:
    """Constrain `share` of the requests (the same ones for every system)."""
    rng = random.Random(seed ^ 0x5EED)
    for r in requests:
        r.structured = rng.random() < share


@dataclass
class WorkloadSpec:
    name: str = "random"
    num_requests: int = 64
    input_len: Lengths = field(default_factory=lambda: Lengths(32, 512))
    output_len: Lengths = field(default_factory=lambda: Lengths(16, 256))
    prefix_len: int = 384  # shared-prefix: tokens every request of a group shares
    groups: int = 8  # shared-prefix groups, or multi-turn sessions
    turns: int = 4  # multi-turn: turns per session
    seed: int = 0


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab) for _ in range(n)]


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def make_serve_workload(spec: WorkloadSpec, vocab_size: int) -> list[ServeRequest]:
    rng = random.Random(spec.seed)
    n = spec.num_requests
    if spec.name == "random":
        return [ServeRequest(i, spec.output_len.draw(rng), _ids(rng, spec.input_len.draw(rng), vocab_size))
                for i in range(n)]
    if spec.name == "chat":
        # Median prompt 256 and answer 128 tokens with a long tail (sigma 1): mostly short, some very long.
        return [ServeRequest(i, _lognormal(rng, 128, 0.8, 4, spec.output_len.high),
                             _ids(rng, _lognormal(rng, 256, 1.0, 8, spec.input_len.high), vocab_size))
                for i in range(n)]
    if spec.name == "shared-prefix":
        prefixes = [_ids(rng, spec.prefix_len, vocab_size) for _ in range(spec.groups)]
        reqs = [ServeRequest(i, spec.output_len.draw(rng),
                             prefixes[i % spec.groups] + _ids(rng, spec.input_len.draw(rng), vocab_size))
                for i in range(n)]
        rng.shuffle(reqs)
        for i, r in enumerate(reqs):
            r.index = i
        return reqs
    if spec.name == "multi-turn":
        sessions = max(1, n // spec.turns) if n >= spec.turns else 1
        return [ServeRequest(s, spec.output_len.draw(rng), session=s, user_turns=[
            " ".join(rng.choice(_WORDS) for _ in range(max(1, spec.input_len.draw(rng) * 3 // 4)))
            for _ in range(spec.turns)]) for s in range(sessions)]
    raise ValueError(f"unknown workload {spec.name!r}: random, chat, shared-prefix or multi-turn")


def arrival_gaps(count: int, rate: float, arrival: str, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive request starts: Poisson (exponential gaps), gamma (burstiness < 1 is
    burstier than Poisson, > 1 more regular; same mean rate), or none (rate infinite, or fixed concurrency)."""
    if arrival == "concurrency" or math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError("rate must be > 0 (or inf)")
    rng = random.Random(seed + 1)
    if arrival == "poisson":
        return [rng.expovariate(rate) for _ in range(count)]
    if arrival == "gamma":
        if burstiness <= 0:
            raise ValueError("burstiness must be > 0")
        return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]
    raise ValueError(f"unknown arrival process {arrival!r}: poisson, gamma or concurrency")
