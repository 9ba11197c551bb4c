"""How many draft tokens a step carries: speculation turns itself down as the batch becomes compute-bound.

The rule. A forward pass over T tokens costs about t(T) = b * (knee + T): a fixed part (reading the
weights, launching the layers) worth `knee` tokens, and b per token. A step whose tokens do U tokens of
useful work (prompt tokens, decode tokens, drafts expected to be accepted) runs at U / t(T). One more
draft token, accepted with probability p, raises that rate if and only if

    p > U / (knee + T)

(its share of the step's time, measured in useful tokens). A step of one decode at a knee of 30 takes
any draft likelier than 1/31; a step already at the knee takes only drafts likelier than 1/2; a step of
ten times the knee (saturation) essentially none: speculation never costs throughput where the batch is
compute-bound, and is nearly free where it is not. Drafts are handed out greedily, likeliest first, and
the rule is re-evaluated after each; every draft also needs room in the step's token budget.

The knee is measured online: every step's wall time and token count feed an exponentially weighted
least-squares fit of t = a + b*T (knee = a / b), so it follows the device and what shares it. A draft's
probability is the product of its sequence's conditional acceptance rates up to its position (the i-th
draft is kept only if all i - 1 before it are), with two rates per sequence: c1 for a first draft, c for
each later one given the one before it was accepted (each starting from a prior worth four trials: for
c1 the replica's recent first-draft rate, at least 0.1, services/scheduler/spec_decode/speculator.py; for
c, 1/2). They
differ: once a draft's first token is right, the model is usually copying, and the next is likelier
(n-gram drafts on the copy-heavy bench: 0.48 at the first position, 0.7-0.9 after it). A single rate
would cut long drafts that are worth their compute.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

DEFAULT_KNEE = 32.0  # until the fit has seen steps of different sizes
_PRIOR_WEIGHT = 4.0  # verified positions the replica-wide rate is worth in a sequence's estimate
_MIN_ACCEPT = 0.02  # below this a draft is never worth its compute


class StepCostModel:
    """t(T) = a + b*T, fitted by exponentially weighted least squares over recent steps."""

    def __init__(self, decay: float = 0.98, pinned_knee: float | None = None):
        self.decay = decay
        self.pinned = pinned_knee
        self._s = [0.0] * 5  # sum of w, w*T, w*T^2, w*y, w*T*y
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        fit = self._fit()
        if fit is not None:
            # A step slowed by something else on the machine must not drag the fit: clip outliers.
            a, b = fit
            seconds = min(seconds, 2.0 * (a + b * tokens))
        d = self.decay
        s = self._s
        t = float(tokens)
        for i, v in enumerate((1.0, t, t * t, seconds, t * seconds)):
            s[i] = s[i] * d + v
        self.steps += 1

    def _fit(self) -> tuple[float, float] | None:
        w, st, stt, sy, sty = self._s
        if self.steps < 8 or w <= 0:
            return None
        var = w * stt - st * st
        if var <= 1e-9 * w * w * max(1.0, stt / w):  # every step the same size: no slope to read
            return None
        b = (w * sty - st * sy) / var
        a = (sy - b * st) / w
        if b <= 0 or a <= 0:
            return None
        return a, b

    @property
    def knee(self) -> float:
        if self.pinned is not None:
            return self.pinned
        fit = self._fit()
        if fit is None:
            return DEFAULT_KNEE
        a, b = fit
        return min(max(a / b, 1.0), 1e6)


class AcceptanceRate:
    """A sequence's accepted drafts over verified positions (up to and including the first rejection), kept
    apart for first drafts and for later ones (given the draft before was accepted)."""

    __slots__ = ("first_accepted", "first_trials", "accepted", "trials")

    def __init__(self):
        self.first_accepted = self.first_trials = 0.0
        self.accepted = self.trials = 0.0

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.first_trials += 1
        if num_accepted:
            self.first_accepted += 1
            self.accepted += num_accepted - 1
            self.trials += num_accepted - 1 + (1 if num_accepted < num_drafts else 0)

    def rate(self, prior: float) -> float:
        """The first draft's acceptance rate."""
        return (self.first_accepted + _PRIOR_WEIGHT * prior) / (self.first_trials + _PRIOR_WEIGHT)

    def then_rate(self, prior: float) -> float:
        """A later draft's, given the one before it was accepted."""
        return (self.accepted + _PRIOR_WEIGHT * prior) / (self.trials + _PRIOR_WEIGHT)


@dataclass
class Candidate:
    key: object  # whatever the caller tells rows apart by
    max_drafts: int
    accept: float  # acceptance rate of the first draft
    then: float | None = None  # of each later draft given the one before was accepted (None: `accept`)


def plan_drafts(candidates: list[Candidate], step_tokens: int, budget: int, knee: float) -> dict[object, int]:
    """Drafts per candidate under the rule above, for a step that already holds `step_tokens` tokens (all
    useful) and has `budget` tokens of room left."""
    heap = [(-c.accept, i, 1) for i, c in enumerate(candidates) if c.max_drafts > 0 and c.accept > _MIN_ACCEPT]
    heapq.heapify(heap)
    given: dict[object, int] = {}
    tokens, useful = float(step_tokens), float(step_tokens)
    while heap and budget > 0:
        neg_p, i, pos = heapq.heappop(heap)
        p = -neg_p
        if p <= useful / (knee + tokens):
            break  # the likeliest remaining draft is not worth its compute: none after it is either
        c = candidates[i]
        given[c.key] = pos
        tokens += 1
        useful += p
        budget -= 1
        nxt = p * (c.accept if c.then is None else c.then)
        if pos < c.max_drafts and nxt > _MIN_ACCEPT:
            heapq.heappush(heap, (-nxt, i, pos + 1))
    return given
