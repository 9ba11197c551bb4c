"""Incremental detokenization and stop-string detection for one sequence, exact for streaming.

Decoding the whole output every step is quadratic; instead we decode a small window and take the new
text once it no longer ends in an incomplete UTF-8 sequence (vLLM's prefix/read offset scheme).

Streams are exact: what a client has been sent is always a prefix of the final text. So the text
that could still turn out to be the start of a stop string (the longest suffix that is a proper prefix
of one) is held back from `visible` until the next tokens settle it, as vLLM and TGI do; a stop string
then never flashes on screen before being cut. Stop strings apply only from `min_tokens` output tokens
on, and only to text not yet shown, so text is never truncated and then continued.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the output so the first word gets its spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop_strings: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = [s for s in stop_strings if s]
        self._include_stop = include_stop
        self._skip = skip_special_tokens
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._held = 0  # characters at the end of `text` that may begin a stop string
        self.text = ""  # everything decoded so far (cut at the stop string once one matched)

    @property
    def visible(self) -> str:
        """What may be streamed now: `text` without the suffix that could still begin a stop string."""
        return self.text[:len(self.text) - self._held] if self._held else self.text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string that matched, if any (text is then cut there)."""
        self._ids.append(token_id)
        self._num_tokens += 1
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # incomplete character (or a special token that decodes to nothing): wait
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        shown = len(self.text) - self._held  # nothing before this was held back: it may have been sent
        self.text += delta
        if not self._stops:
            return None
        if self._num_tokens >= self._min_tokens:
            match = self._first_stop(shown)
            if match is not None:
                at, stop = match
                self.text = self.text[:at + len(stop)] if self._include_stop else self.text[:at]
                self._held = 0
                return stop
        self._held = self._stop_prefix_suffix()
        return None

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string in text[start:] (ties: the longer, so include_stop shows all of it)."""
        best = None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or (at, -len(stop)) < (best[0], -len(best[1]))):
                best = (at, stop)
        return best

    def _stop_prefix_suffix(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        text, longest = self.text, 0
        for stop in self._stops:
            window = min(len(stop) - 1, len(text))
            if window <= longest:
                continue
            tail_start = len(text) - window
            # Candidates start where the stop's first character occurs in the tail; few in real text.
            i = text.find(stop[0], tail_start)
            while i != -1:
                k = len(text) - i
                if k <= longest:
                    break
                if stop.startswith(text[i:]):
                    longest = k
                    break  # the earliest candidate is the longest suffix for this stop
                i = text.find(stop[0], i + 1)
        return longest
