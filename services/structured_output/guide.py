"""One sequence's grammar state: the matcher that says which tokens may come next.

Lives on a scheduler `Sequence` and is advanced only when a token is committed to it (never when a
step is scheduled, re-run by step isolation or recomputed after preemption), so it always sits at the
end of the sequence's committed output. A fork of an `n > 1` request clones it before either side
advances.
"""

from __future__ import annotations

import ctypes
import threading

_executor = None
_executor_lock = threading.Lock()


def bitmask_bytes(vocab_size: int) -> int:
    """Size of a packed token mask: one bit per token id, in little-endian int32 words."""
    return 4 * ((vocab_size + 31) // 32)


def compute_bitmasks(guides: list[SequenceGuide], num_bytes: int) -> list[bytes]:
    """The next-token masks of several guides at once, on llguidance's own threads (it drops the GIL)."""
    if len(guides) == 1:
        return [guides[0].bitmask(num_bytes)]
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
    buf = bytearray(num_bytes * len(guides))
    view = (ctypes.c_char * len(buf)).from_buffer(buf)  # kept alive while llguidance writes through it
    _executor.unsafe_compute_mask_ptr([(g._matcher, i) for i, g in enumerate(guides)], ctypes.addressof(view),
                                      num_bytes, len(guides))
    del view
    return [bytes(buf[i * num_bytes:(i + 1) * num_bytes]) for i in range(len(guides))]


class SequenceGuide:
    __slots__ = ("_matcher",)

    def __init__(self, matcher):
        self._matcher = matcher

    def bitmask(self, num_bytes: int) -> bytes:
        """The tokens allowed next (EOS among them once the grammar may end), packed, `num_bytes` long."""
        mask = self._matcher.compute_bitmask()
        if len(mask) >= num_bytes:
            return mask[:num_bytes]
        return mask + bytes(num_bytes - len(mask))

    def accept(self, token: int) -> bool:
        """Advance past a committed token; False when the grammar does not allow it (the guide is then dead)."""
        if token < 0:
            return False
        return self._matcher.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would accept from here (the state is unchanged)."""
        return self._matcher.validate_tokens(tokens)

    def bitmasks_along(self, tokens: list[int], num_bytes: int) -> list[bytes]:
        """The masks before each of `tokens` and after the last (len + 1 of them), as if they were
        committed; the state is rolled back after. `tokens` must be a valid prefix (`valid_prefix`)."""
        masks = [self.bitmask(num_bytes)]
        m = self._matcher
        consumed = 0
        try:
            for t in tokens:
                if not m.consume_token(t):
                    raise AssertionError(f"draft token {t} was validated but the grammar refuses it")
                consumed += 1
                masks.append(self.bitmask(num_bytes))
        finally:
            if consumed:
                m.rollback(consumed)
        return masks

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the sequence ends here."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        m = self._matcher
        if not m.is_error():
            return None
        text = m.get_error().strip()
        return text.splitlines()[0][:400] if text else "the grammar cannot continue"

    def clone(self) -> SequenceGuide:
        return SequenceGuide(self._matcher.deep_copy())
