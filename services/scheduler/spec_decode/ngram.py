"""Prompt-lookup (n-gram) drafts: the tokens that followed the longest earlier occurrence of the sequence's
last n tokens, n in [prompt_lookup_min, prompt_lookup_max]; among equally long matches the earliest (as
vLLM's NgramProposer). Model-free, so the scheduler proposes them itself from the committed tokens.

The scheduler process carries neither torch nor numpy (its image has neither): each sequence keeps its
tokens in a growing int32 `array` (`TokenBuffer`), appended as tokens commit, and a lookup is at most
`prompt_lookup_max - prompt_lookup_min + 1` searches of the last n tokens' bytes in the earlier tokens'
bytes (`bytes.find`, C speed), longest n first; a hit at an offset that is not a token boundary is skipped.
"""

from __future__ import annotations

from array import array

_ITEM = array("i").itemsize  # 4: token ids are int32 (a vocabulary is far below 2^31)


class TokenBuffer:
    """A sequence's committed tokens as int32, kept in step with its token list by `sync`."""

    __slots__ = ("buf",)

    def __init__(self):
        self.buf = array("i")

    def sync(self, tokens: list[int]) -> array:
        """The buffer holding `tokens` (which only ever grows; a shorter list resets it)."""
        n = len(self.buf)
        if len(tokens) < n:
            del self.buf[:]
            n = 0
        if len(tokens) > n:
            self.buf.extend(tokens[n:])
        return self.buf


def _find_aligned(hay: bytes, pattern: bytes) -> int:
    """The first token-aligned byte offset of `pattern` in `hay`, or -1."""
    at = hay.find(pattern)
    while at != -1 and at % _ITEM:
        at = hay.find(pattern, at + 1)
    return at


def propose_ngram(tokens: array | list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the longest (then earliest) earlier match of the context's last n tokens."""
    total = len(tokens)
    if total <= min_n or k <= 0:
        return []
    buf = tokens if isinstance(tokens, array) else array("i", tokens)
    raw = buf.tobytes()
    hay = raw[:(total - 1) * _ITEM]  # a match must end before the last token
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        at = _find_aligned(hay, raw[(total - n) * _ITEM:])
        if at != -1:
            start = at // _ITEM + n  # the token after the earliest occurrence
            return buf[start:start + k].tolist()
    return []
