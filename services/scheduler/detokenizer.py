"""Incremental detokenization and stop-string detection for one sequence.

Decoding the whole output every step is quadratic; instead we decode a small window and emit the new
text once it no longer ends in an incomplete UTF-8 sequence (vLLM's prefix/read offset scheme).
"""

from __future__ import annotations

from tokenizers import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the output so the first word gets its spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop_strings: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = stop_strings
        self._max_stop = max((len(s) for s in stop_strings), default=0)
        self._include_stop = include_stop
        self._skip = skip_special_tokens
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string that matched, if any (text is then truncated)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # incomplete character (or a special token that decodes to nothing): wait
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += delta
        if not self._stops:
            return None
        # Only the new text (plus a stop-length tail before it) can contain a new match.
        search_from = max(0, old_len - self._max_stop + 1)
        for stop in self._stops:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[:at + len(stop)] if self._include_stop else self.text[:at]
                return stop
        return None

