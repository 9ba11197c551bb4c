"""LoRA residency as a scheduling constraint: at most `max_loras` distinct adapters among the running
sequences (so every step fits the engine's slots), and which adapter sits in which slot.

The scheduler admits a waiting request only if its adapter is already running or a slot is free, and
prefers (lets past a blocked head) requests whose adapter is running: a request for an adapter that is
not resident waits for a slot rather than evicting one under a running sequence. A slot keeps its
adapter after its last sequence ends, so the next request for it costs no copy; a new adapter takes
the free slot used least recently. No torch here: slots are numbers, adapters their digests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRef:
    """The adapter a request runs with: the name it asked for and the content it gets (the digest)."""

    name: str
    digest: str  # sha256 hex of its files: its identity and the root of its block-hash chain
    path: str = ""
    rank: int = 0


class LoraResidency:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slots: list[str | None] = [None] * max_loras
        self._last_use = [0] * max_loras
        self._clock = 0

    @staticmethod
    def active(seqs: Iterable) -> set[str]:
        """The digests of the adapters the sequences run with."""
        return {s.lora.digest for s in seqs if s.lora is not None}

    def admits(self, lora: LoraRef | None, active: set[str]) -> bool:
        """Whether a sequence of `lora` may join the running ones without a (max_loras + 1)-th adapter."""
        return lora is None or lora.digest in active or len(active) < self.max_loras

    def assign(self, digests: set[str], active: set[str]) -> dict[str, int]:
        """A slot for each adapter of this step; a new one takes a slot whose adapter no running sequence
        uses, least recently used first (the engine copies it in). `active` covers `digests`."""
        self._clock += 1
        out: dict[str, int] = {}
        for d in sorted(digests):
            if d in self.slots:
                out[d] = self.slots.index(d)
        for d in sorted(digests - out.keys()):
            free = [i for i, held in enumerate(self.slots) if held is None or held not in active]
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._last_use[i]))
            self.slots[slot] = d
            out[d] = slot
        for slot in out.values():
            self._last_use[slot] = self._clock
        return out

    def forget(self, digest: str) -> None:
        """An adapter unloaded from the engine: its slot holds nothing the scheduler can name."""
        for i, held in enumerate(self.slots):
            if held == digest:
                self.slots[i] = None
