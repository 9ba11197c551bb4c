"""The beam-search decision of one request: which beams continue, which finish, when the search ends.

Pure bookkeeping over the top-K log-probabilities each live beam gets from the engine; the engine core
turns the decisions into sequences (a continuing beam appends its token, a beam chosen twice forks and
shares its KV blocks, a beam chosen never is dropped and its blocks freed). No torch here.

Scoring follows transformers' `generate(num_beams=W, do_sample=False)` (the version pinned in
pyproject.toml, 5.x), step for step:
- K = max(2, 1 + number of end tokens) * W candidates per step, the best K (beam, token) pairs by
  cumulative log-probability over all live beams;
- a candidate that ends (an end token, or the length limit) is a finished hypothesis only if it ranks in
  the first W of the K; its score is cumulative logprob / generated_tokens ** length_penalty, where
  generated_tokens counts the new tokens including the end token, not the prompt (vLLM's own
  `beam_search` divides by prompt + output without the EOS instead: we follow transformers);
- the next live beams are the best W candidates that did not end;
- the W best finished hypotheses are kept; the search ends when every candidate of a step ends (length
  limit), when W hypotheses are finished and `early_stopping` is True, or when they are finished and the
  best live beam cannot beat the worst of them: its score now (early_stopping False), or, with
  early_stopping "never" and a positive length penalty, its score at the length limit.
Sums and scores are rounded to float32 as transformers computes them, so near-ties rank the same way.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from services.contracts.step_protocol import TokenLogprobs

_F32 = struct.Struct("<f")


def f32(x: float) -> float:
    """`x` rounded to float32, as a torch float32 tensor would hold it."""
    return _F32.unpack(_F32.pack(x))[0]


@dataclass(slots=True)
class BeamCandidates:
    """One live beam as the search sees it: its cumulative logprob and the engine's top-K for its next token."""

    cum_logprob: float
    top: TokenLogprobs


@dataclass(slots=True)
class Continuation:
    parent: int  # index of the live beam it extends
    token: int
    cum_logprob: float
    logprob: float


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: the tokens it generated (its end token included) and how it ranks."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    ended: bool  # True: by an end token; False: by the length limit
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class BeamSearch:
    width: int
    end_ids: frozenset[int]
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_logprobs: int = 0  # alternatives kept per token when the request asks for logprobs
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    done: bool = False
    _improvable: bool = True

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.end_ids)) * self.width

    def chosen(self, top: TokenLogprobs, logprob: float) -> TokenLogprobs:
        """The logprobs entry of a token the search chose, with the alternatives the request asked for."""
        k = self.num_logprobs
        return TokenLogprobs(logprob, top.top_ids[:k], top.top_logprobs[:k])

    def step(self, beams: list[BeamCandidates], num_generated: int,
             history: list[tuple[list[int], list[TokenLogprobs] | None]]) -> list[Continuation]:
        """One step over the live beams, each `num_generated` tokens long, whose generated tokens (and
        logprobs, if kept) are `history`. Records the hypotheses that finish and returns the live beams
        of the next step (empty once the search is done)."""
        k = self.num_candidates
        pool: list[tuple[float, int, int, float]] = []  # (cumulative, flat index, token, logprob)
        for b, beam in enumerate(beams):
            for tok, lp in zip(beam.top.top_ids, beam.top.top_logprobs, strict=True):
                pool.append((f32(beam.cum_logprob + lp), b, tok, lp))
        # transformers' topk over the flattened [beam, vocab] scores: best first, lower index on ties.
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pool[:k]
        new_len = num_generated + 1
        at_limit = new_len >= self.max_new_tokens
        ends = [at_limit or tok in self.end_ids for _, _, tok, _ in top]

        full = len(self.finished) >= self.width and self.early_stopping is True
        if self._improvable and not full:
            denom = f32(float(new_len) ** self.length_penalty)
            for rank, (cum, b, tok, lp) in enumerate(top[:self.width]):
                if ends[rank]:
                    tokens, lps = history[b]
                    kept = None if lps is None else [*lps, self.chosen(beams[b].top, lp)]
                    self.finished.append(Hypothesis([*tokens, tok], cum, f32(cum / denom),
                                                    tok in self.end_ids, kept))
            # Stable: a hypothesis finished earlier stays ahead of an equal newcomer, as in the merge.
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]

        running = [Continuation(b, tok, cum, lp) for (cum, b, tok, lp), end in zip(top, ends, strict=True)
                   if not end]
        running = running[:self.width]
        if self._improvable and len(self.finished) >= self.width and running:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_len = self.max_new_tokens
            else:
                best_len = new_len
            best_possible = f32(running[0].cum_logprob / f32(float(best_len) ** self.length_penalty))
            self._improvable = best_possible > min(h.score for h in self.finished)
        full = len(self.finished) >= self.width and self.early_stopping is True
        if all(ends) or not self._improvable or full or not running:
            self.done = True
            return []
        return running


