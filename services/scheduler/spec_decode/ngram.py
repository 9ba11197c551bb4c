"""Prompt-lookup (n-gram) drafts: the tokens that followed the longest earlier occurrence of the sequence's
last n tokens, n in [prompt_lookup_min, prompt_lookup_max]; among equally long matches the earliest (as
vLLM's NgramProposer). Model-free, so the scheduler proposes them itself from the committed tokens.

Each sequence keeps its tokens in a growing int32 buffer (`TokenBuffer`), appended as tokens commit, so a
lookup costs a vectorised scan for the last token plus `prompt_lookup_max` compares per candidate, never a
conversion of the whole context.
"""

from __future__ import annotations

import numpy as np


class TokenBuffer:
    """A sequence's committed tokens as int32, kept in step with its token list by `sync`."""

    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf = np.empty(256, dtype=np.int32)
        self.n = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """The buffer's view of `tokens` (which only ever grows; a shorter list resets it)."""
        if len(tokens) < self.n:
            self.n = 0
        if len(tokens) > self.n:
            if len(tokens) > len(self.buf):
                grown = np.empty(max(len(tokens), 2 * len(self.buf)), dtype=np.int32)
                grown[:self.n] = self.buf[:self.n]
                self.buf = grown
            self.buf[self.n:len(tokens)] = tokens[self.n:]
            self.n = len(tokens)
        return self.buf[:self.n]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the longest (then earliest) earlier match of the context's last n tokens."""
    total = len(tokens)
    if total <= min_n or k <= 0:
        return []
    last = tokens[total - 1]
    ends = np.flatnonzero(tokens[:total - 1] == last)  # where an earlier match could end
    if not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int32)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        if j >= total:
            break
        pos = ends - j
        ok = alive & (pos >= 0)
        ok[ok] = tokens[pos[ok]] == tokens[total - 1 - j]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < min_n:
        return []
    start = int(ends[np.argmax(length == best)]) + 1  # the earliest of the longest matches
    return tokens[start:start + k].tolist()
