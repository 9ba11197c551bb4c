"""The LoRA adapters one replica serves, by name: loading them into its engine and unloading them
without failing a request in flight.

A name maps to a `LoraRef` (its digest is what the engine knows it by). Loading a name again with new
files gives it a new digest: requests already running keep the old adapter to their end, new ones get
the new one, and their cached blocks never mix (the digest roots each chain). Unloading takes the name
away at once; the engine drops the adapter's weights only once no request holds it any more. Runs on
the step loop's thread, like every other call into the core."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from services.model_files.lora_files import AdapterError
from services.scheduler.lora_residency import LoraRef, LoraResidency

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, executor, residency: LoraResidency | None):
        self.executor = executor
        self.residency = residency
        self.by_name: dict[str, LoraRef] = {}
        self._retired: set[str] = set()  # digests no name maps to, to drop from the engine once unused

    def get(self, name: str) -> LoraRef | None:
        return self.by_name.get(name)

    def load(self, name: str, path: str) -> LoraRef:
        """Load the adapter at `path` (already checked to be an allowed place) under `name`; raises
        AdapterError naming what is wrong with it."""
        if self.residency is None:
            raise AdapterError("lora_name", "this replica's engine has no LoRA slots (start the engine with "
                               "--max-loras)")
        info = self.executor.load_lora(path)
        ref = LoraRef(name, info["digest"], path, info["rank"])
        old = self.by_name.get(name)
        self.by_name[name] = ref
        self._retired.discard(ref.digest)
        if old is not None and old.digest != ref.digest:
            self._retired.add(old.digest)
        log.info("LoRA adapter %r loaded from %s (digest %s, rank %d)", name, path, ref.digest[:12], ref.rank)
        return ref

    def unload(self, name: str) -> LoraRef:
        ref = self.by_name.pop(name, None)
        if ref is None:
            raise AdapterError("lora_name", f"no adapter named {name!r} is loaded")
        self._retired.add(ref.digest)
        log.info("LoRA adapter %r unloaded (digest %s)", name, ref.digest[:12])
        return ref

    def release_unused(self, in_use: Iterable[str]) -> None:
        """Drop from the engine the retired adapters no request holds any more (between steps)."""
        if not self._retired:
            return
        named = {r.digest for r in self.by_name.values()}
        for digest in self._retired - set(in_use) - named:
            self.executor.unload_lora(digest)
            self.residency.forget(digest)
            self._retired.discard(digest)
        self._retired -= named
