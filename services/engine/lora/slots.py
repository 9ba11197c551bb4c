"""Fixed LoRA slot buffers on the device, and the host-memory LRU of loaded adapters behind them.

`max_loras` slots, each holding one adapter's A and B matrices for every layer and projection, padded
to `max_rank` with zeros (a zero row of A and a zero column of B add exactly nothing): the buffers are
allocated once and never change shape, so a captured CUDA graph's pointers stay valid whichever
adapters are resident. The scheduler decides which adapter sits in which slot (it sees residency as a
constraint); a step names its slots' adapters and `activate` copies in the ones not already there.

Loaded adapters live in host memory, least recently used first out beyond `max_cpu_loras`; one that
was pushed out must be added again before a slot can take it (services/engine/lora/adapters.py reads
it again from its files, and refuses it if they changed: its digest is its identity). Under tensor
parallelism every rank holds its own slice in slots of its own shapes, and the same operations in the
same order keep every rank's slots and LRU identical."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from services.engine.lora.weights import GROUPS, LoraWeights, module_dims

if TYPE_CHECKING:
    from services.engine.tp_shard import TensorParallelShard

log = logging.getLogger(__name__)


class LoraSlots:
    def __init__(self, config, shard: TensorParallelShard | None, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, max_cpu_loras: int):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        dims = (module_dims(config) if shard is None
                else module_dims(config, shard.num_heads, shard.num_kv_heads, shard.intermediate))
        # Where each part of a fused projection sits in its output: (offset, size) per PEFT module.
        self.parts: dict[str, list[tuple[int, int]]] = {}
        for group, modules in GROUPS.items():
            at, parts = 0, []
            for m in modules:
                parts.append((at, dims[m][1]))
                at += dims[m][1]
            self.parts[group] = parts

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.a = [{g: zeros(max_loras, len(mods) * max_rank, dims[mods[0]][0]) for g, mods in GROUPS.items()}
                  for _ in range(config.num_layers)]
        # B is kept outputs-first ([out, slot, rank]): viewed as [out, slots x rank] it expands every slot's
        # shrink in one GEMM (services/engine/lora/batch.py).
        self.b = [{g: zeros(sum(dims[m][1] for m in mods), max_loras, max_rank) for g, mods in GROUPS.items()}
                  for _ in range(config.num_layers)]
        self.scales = [0.0] * max_loras
        self.scale_tensor = torch.zeros(max_loras, dtype=torch.float32, device=device)  # for captured graphs
        self.resident: list[str | None] = [None] * max_loras
        self.host: OrderedDict[str, LoraWeights] = OrderedDict()
        self.paths: dict[str, str] = {}  # digest -> directory, to read it again after the LRU dropped it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in (*self.a, *self.b) for t in layer.values())

    def add(self, weights: LoraWeights, path: str) -> None:
        self.paths[weights.digest] = path
        self._remember(weights)

    def remove(self, digest: str) -> None:
        """Forget an adapter (a slot holding it keeps it until the scheduler gives the slot to another)."""
        self.host.pop(digest, None)
        self.paths.pop(digest, None)

    def knows(self, digest: str) -> bool:
        return digest in self.paths

    def holds(self, digest: str) -> bool:
        """In host memory now (not pushed out by the LRU)."""
        return digest in self.host

    def _remember(self, weights: LoraWeights) -> None:
        self.host[weights.digest] = weights
        self.host.move_to_end(weights.digest)
        while len(self.host) > self.max_cpu_loras:
            dropped, _ = self.host.popitem(last=False)
            log.info("LoRA adapter %s left host memory (LRU, --max-cpu-loras %d)", dropped[:12], self.max_cpu_loras)

    def activate(self, slot: int, digest: str) -> None:
        """Make `slot` hold adapter `digest`, which must be in host memory (a copy only when the slot
        holds another one)."""
        if self.resident[slot] == digest:
            return
        weights = self.host[digest]
        self._remember(weights)
        r, rmax = weights.rank, self.max_rank
        for layer, mods in enumerate(weights.layers):
            for group, modules in GROUPS.items():
                a, b = self.a[layer][group][slot], self.b[layer][group][:, slot]
                a.zero_()
                b.zero_()
                for j, (m, (off, size)) in enumerate(zip(modules, self.parts[group], strict=True)):
                    if m in mods:
                        wa, wb = mods[m]
                        a[j * rmax:j * rmax + r].copy_(wa)
                        b[off:off + size, :r].copy_(wb)
        self.scales[slot] = weights.scale
        self.scale_tensor[slot] = weights.scale
        self.resident[slot] = digest
