"""An engine's LoRA adapters: loading and unloading them, and putting a step's adapters into their
slots, on one process or on every rank of a tensor-parallel group alike.

Rank 0 (or the only process) reads and checks an adapter's files and the shapes against the model
before anything changes, so a bad adapter is an AdapterError and no rank has moved. Every change is
then a `LoraCommand` that rank 0 applies and sends to the other ranks (`send`, rank 0's step
broadcast), which apply the same commands in the same order (`receive`): each slices its own shard
from the same bytes, and every rank's slots and host LRU hold the same adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.contracts.step_protocol import InvalidStepError, SchedulerOutput, StepFault
from services.engine.lora.commands import LoraCommand, decode, encode
from services.engine.lora.slots import LoraSlots
from services.engine.lora.weights import LoraWeights, load_weights
from services.model_files.lora_files import AdapterError, AdapterFiles, read_adapter

if TYPE_CHECKING:
    from services.engine.config import EngineConfig
    from services.engine.tp_shard import TensorParallelShard

log = logging.getLogger(__name__)


class LoraAdapters:
    """`send(payload)`: hands encoded commands to the other ranks (None: no other rank)."""

    def __init__(self, config: EngineConfig, model_config, shard: TensorParallelShard | None, dtype: torch.dtype,
                 device: torch.device, send: Callable[[bytes], None] | None = None):
        self.max_rank = config.max_lora_rank
        self.model_config, self.shard, self.dtype = model_config, shard, dtype
        self.slots = LoraSlots(model_config, shard, config.max_loras, config.max_lora_rank, dtype, device,
                               config.max_cpu_loras or max(config.max_loras, 8))
        self.send = send

    def _weights(self, files: AdapterFiles) -> LoraWeights:
        return load_weights(files, self.model_config, self.dtype, self.shard)

    def _read(self, digest: str | None, path: str) -> tuple[AdapterFiles, LoraWeights]:
        """The adapter in directory `path`, checked; `digest`: what it must still be (a reload)."""
        files = read_adapter(path, path, self.max_rank)
        if digest is not None and files.digest != digest:
            raise AdapterError("lora_path", f"the files of adapter {digest[:12]} changed since it was loaded: load "
                               f"it again (a new digest)")
        return files, self._weights(files)

    def _apply(self, c: LoraCommand, weights: LoraWeights | None = None) -> None:
        if c.op == "add":
            self.slots.add(weights if weights is not None else self._weights(c.files), c.path)
        elif c.op == "forget":
            self.slots.remove(c.digest)
        elif c.op == "activate":
            self.slots.activate(c.slot, c.digest)
        else:
            raise ValueError(f"unknown LoRA command {c.op!r}")

    def _share(self, done: list[LoraCommand]) -> None:
        if done and self.send is not None:
            self.send(encode(done))

    def receive(self, payload: bytes | memoryview) -> None:
        """Another rank's side: apply what rank 0 applied."""
        for c in decode(payload):
            self._apply(c)

    def load(self, path: str) -> dict:
        """Read, check and keep the adapter in directory `path` (trusted: the scheduler checked where it is);
        returns {"digest", "rank"}. Raises AdapterError naming what is wrong, before any rank changes."""
        files, weights = self._read(None, path)
        add = LoraCommand("add", files.digest, path, files=files)
        self._share([add])
        self._apply(add, weights)
        log.info("LoRA adapter %s loaded from %s: rank %d, %.1f MiB%s", files.digest[:12], path, files.rank,
                 weights.nbytes / 2**20, "" if self.shard is None else f" on rank 0 of {self.shard.size}")
        return {"digest": files.digest, "rank": files.rank}

    def unload(self, digest: str) -> None:
        forget = LoraCommand("forget", digest)
        self._share([forget])
        self._apply(forget)

    def knows(self, digest: str) -> bool:
        return self.slots.knows(digest)

    def activate(self, out: SchedulerOutput) -> None:
        """Check the step's LoRA fields, then copy into its slots the adapters they must hold (reading
        again from its files one the host LRU let go)."""
        slots = check_step_slots(out, self.slots.max_loras, self.slots.knows)
        done: list[LoraCommand] = []
        try:
            for slot, digest in slots.items():
                if self.slots.resident[slot] == digest:
                    continue
                if not self.slots.holds(digest):
                    path = self.slots.paths[digest]
                    files, weights = self._read(digest, path)
                    add = LoraCommand("add", digest, path, files=files)
                    self._apply(add, weights)
                    done.append(add)
                act = LoraCommand("activate", digest, slot=slot)
                self._apply(act)
                done.append(act)
        finally:  # what this rank applied, the others apply too, even when a reload then failed
            self._share(done)


def check_step_slots(out: SchedulerOutput, max_loras: int, knows: Callable[[str], bool]) -> dict[int, str]:
    """The step's slots whose adapter is loaded here, {slot: digest}; raises InvalidStepError naming each
    bad `lora_slots` pair and each sequence whose `lora_slot` names no loaded adapter (`max_loras` 0: an
    engine without adapters, where every sequence must be -1)."""
    faults, slots = [], {}
    n = max_loras
    for pair in out.lora_slots:
        ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and type(pair[0]) is int and 0 <= pair[0] < n
              and isinstance(pair[1], str) and pair[0] not in slots)
        if not ok:
            faults.append(StepFault(None, "lora_slots", f"{pair!r} is not a (slot < {n}, digest) pair"))
        else:
            slots[pair[0]] = pair[1] if knows(pair[1]) else None
    for s in out.sequences:
        slot = s.lora_slot
        if type(slot) is not int or not -1 <= slot < n:
            faults.append(StepFault(s.seq_id, "lora_slot", f"{slot!r} is not -1 or a slot below {n}"))
        elif slot >= 0 and slot not in slots:
            faults.append(StepFault(s.seq_id, "lora_slot", f"slot {slot} is not named in lora_slots"))
        elif slot >= 0 and slots[slot] is None:
            faults.append(StepFault(s.seq_id, "lora_slot", f"slot {slot}'s adapter is not loaded here"))
    if faults:
        raise InvalidStepError.from_faults(faults)
    return {slot: digest for slot, digest in slots.items() if digest is not None}
