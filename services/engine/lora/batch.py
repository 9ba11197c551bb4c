"""The LoRA part of one step's forward: every token's adapter (its slot) and, per projection, a shrink
(x @ A^T, to the padded rank) then an expand (@ B^T, times the adapter's scale) added to the output, as
PEFT computes it (`base(x) + B(A(x)) * scaling`).

On the CPU (torch GEMMs) the slots the step uses (from the first to the last of them) go at once: one GEMM
shrinks the span of tokens that holds every adapter token against each of those slots' A, a mask keeps each
token's own slot (times its scale; zero for the base model's tokens), and one `addmm_` per part of a fused
projection expands against those slots' B and adds into the output in place. That is a fixed handful of
operations per projection whatever the number of adapters in the step (a loop over slots cost 4x the
operations at 4 adapters, and the expand's separate add a second pass over the output). On CUDA the Triton
kernel does the same per token (kernels/triton_lora.py: a slot index per token, read on the device; set
PAGEDSERVE_LORA_KERNEL=triton to run it through Triton's interpreter on the CPU). With no adapter in the
step there is no LoraBatch at all, and the step is built on the host (each sequence has one slot), so the
forward reads no device value back.

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

import os
from dataclasses import dataclass

import torch

from services.engine.lora.slots import LoraSlots


def slots_per_token(segments: list[tuple[int, int, int]], lo: int, n: int) -> torch.Tensor:
    """int32 [n]: the slot of each of the step's tokens lo..lo+n-1 (-1: the base model), from its (slot,
    first token, end token) ranges."""
    out = torch.full((n,), -1, dtype=torch.int32)
    for slot, start, end in segments:
        out[start - lo:end - lo] = slot
    return out


@dataclass
class LoraBatch:
    slots: LoraSlots
    lo: int  # the step's tokens lo..hi-1 hold every adapter token (base tokens among them add zero)
    hi: int
    weight: torch.Tensor  # [hi - lo, slots, 1, 1]: a token's adapter scale at its slot, 0 elsewhere
    token_slots: torch.Tensor  # int32 [hi - lo]: each token's slot, -1 for the base model (the kernel's)
    scales: torch.Tensor  # float32 [slots]
    triton: bool
    # The slots first..end-1 hold every adapter the step uses: the torch path shrinks and expands only
    # those (one adapter in the step costs a quarter of four slots' GEMMs, not all of them).
    first: int = 0
    end: int | None = None

    @classmethod
    def of(cls, slots: LoraSlots, segments: list[tuple[int, int, int]], device: torch.device) -> LoraBatch | None:
        """From the step's (slot, first token, end token) ranges; None when no token uses an adapter."""
        live = [(slot, start, end) for slot, start, end in segments if slot >= 0 and end > start]
        if not live:
            return None
        lo, hi = min(start for _, start, _ in live), max(end for _, _, end in live)
        token_slots = slots_per_token(live, lo, hi - lo)
        scales = torch.tensor(slots.scales, dtype=torch.float32)
        used = token_slots >= 0
        weight = torch.zeros(hi - lo, slots.max_loras, dtype=torch.float32)
        rows = torch.nonzero(used).flatten()
        weight[rows, token_slots[rows].long()] = scales[token_slots[rows].long()]
        dtype = slots.a[0][next(iter(slots.a[0]))].dtype
        triton = device.type == "cuda" or os.environ.get("PAGEDSERVE_LORA_KERNEL") == "triton"
        used_slots = [slot for slot, _, _ in live]
        first, end = min(used_slots), max(used_slots) + 1
        return cls(slots, lo, hi, weight[:, first:end].to(dtype)[:, :, None, None].to(device, non_blocking=True),
                   token_slots.to(device, non_blocking=True), scales.to(device, non_blocking=True), triton,
                   first, end)

    @classmethod
    def on_device(cls, slots: LoraSlots, token_slots: torch.Tensor) -> LoraBatch:
        """For a captured decode graph: every token's slot read from a static device tensor (-1: the base
        model; a step's slots are copied in before each replay), the scale mask computed on the device,
        inside the graph, so it follows the slots at every replay."""
        idx = token_slots.clamp(min=0).long()
        scale = slots.scale_tensor[idx] * (token_slots >= 0)
        weight = torch.zeros(token_slots.shape[0], slots.max_loras, dtype=torch.float32, device=token_slots.device)
        weight.scatter_(1, idx[:, None], scale[:, None])
        dtype = slots.a[0][next(iter(slots.a[0]))].dtype
        triton = token_slots.is_cuda or os.environ.get("PAGEDSERVE_LORA_KERNEL") == "triton"
        return cls(slots, 0, token_slots.shape[0], weight.to(dtype)[:, :, None, None], token_slots,
                   slots.scale_tensor, triton)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[t] += B(A(x[t])) * scale for every token t of an adapter (in place)."""
        a_all, b_all = self.slots.a[layer][group], self.slots.b[layer][group]  # [S, P*r, in], [out, S, r]
        parts, r = self.slots.parts[group], self.slots.max_rank
        xs, os_ = x[self.lo:self.hi], out[self.lo:self.hi]
        if self.triton:
            from kernels.triton_lora import lora_apply

            lora_apply(xs, os_, a_all, b_all.permute(1, 0, 2), self.token_slots, self.scales, parts, r)
            return
        a_all, b_all = a_all[self.first:self.end], b_all[:, self.first:self.end]  # views: no copy
        n_slots, tokens = a_all.shape[0], xs.shape[0]
        xa = (xs @ a_all.reshape(-1, a_all.shape[2]).t()).view(tokens, n_slots, len(parts), r) * self.weight
        expand = b_all.view(b_all.shape[0], n_slots * r)  # [out, n, r] slots of [out, S, r]: still a view
        for j, (off, size) in enumerate(parts):
            os_[:, off:off + size].addmm_(xa[:, :, j].reshape(tokens, n_slots * r), expand[off:off + size].t())
