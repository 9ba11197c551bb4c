"""The LoRA part of one step's forward: its tokens grouped by adapter slot, and per slot a shrink
(x @ A^T, to the padded rank) then an expand (@ B^T, times the adapter's scale) added to the output of
each projection, as PEFT computes it (`base(x) + B(A(x)) * scaling`).

Base-model tokens belong to no group and cost nothing; with no adapter in the step there is no
LoraBatch at all. The grouping is known on the host when the step is built (each sequence has one
slot), so the forward reads no device value back. Torch GEMMs, on any device.

Under tensor parallelism each rank applies its slices (services/engine/lora/weights.py) to its part of
the projection. Column-parallel (qkv, gate_up): the whole A, so every rank shrinks the whole input, and
B's rows for this rank's output columns: its delta is exactly its columns of the whole delta. Row-
parallel (o, down): the base output is a partial sum that the all-reduce after it completes, and the
delta joins it: this rank's columns of A shrink its part of the input, the whole B expands that partial
shrink, and the all-reduce sums the ranks' deltas with their base outputs. Since the expand is linear,
the sum over ranks of (x_r A_r^T) B^T is (x A^T) B^T, the whole delta: exact (only the order of the
float additions differs, as for the base output's own partial sums), and no collective of its own. This
is vLLM's RowParallelLinearWithLoRA; its fully sharded variant all-reduces the shrink output instead, to
shard B too, at one more collective per projection: B (hidden x r) is small next to the base weight at
the adapter ranks served here, so that collective would buy little."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.lora.slots import LoraSlots


@dataclass
class LoraBatch:
    slots: LoraSlots
    groups: list[tuple[int, torch.Tensor, float]]  # (slot, indices of its tokens in the batch, scale)

    @classmethod
    def of(cls, slots: LoraSlots, segments: list[tuple[int, int, int]], device: torch.device) -> LoraBatch | None:
        """From the step's (slot, first token, end token) ranges; None when no token uses an adapter."""
        by_slot: dict[int, list[torch.Tensor]] = {}
        for slot, start, end in segments:
            if slot >= 0:
                by_slot.setdefault(slot, []).append(torch.arange(start, end, dtype=torch.int64))
        if not by_slot:
            return None
        groups = [(slot, torch.cat(r).to(device, non_blocking=True), slots.scales[slot])
                  for slot, r in sorted(by_slot.items())]
        return cls(slots, groups)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[t] += B(A(x[t])) * scale for every token t of an adapter (in place)."""
        a_all, b_all = self.slots.a[layer][group], self.slots.b[layer][group]
        parts, r = self.slots.parts[group], self.slots.max_rank
        for slot, idx, scale in self.groups:
            xa = x.index_select(0, idx) @ a_all[slot].t()
            b = b_all[slot]
            if len(parts) == 1:
                delta = xa @ b.t()
            else:
                delta = torch.cat([xa[:, j * r:(j + 1) * r] @ b[off:off + size].t()
                                   for j, (off, size) in enumerate(parts)], dim=1)
            out.index_add_(0, idx, delta * scale)
