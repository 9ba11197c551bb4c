"""Grouping a MoE layer's (token, slot) pairs by expert: computed once per layer call from topk_ids and
shared by both projections, for the CPU path (runs per expert) and, padded to the tile height, for the
Triton kernel (tiles of one expert each, vLLM's moe_align_block_size).

Pure torch and vectorized: a stable argsort of the flattened ids, counts by scatter-add, offsets by
cumsum. On CUDA nothing here reads the device back to the host and every shape depends only on T, K, E
and the tile height, so it neither syncs nor breaks a CUDA graph (counts use scatter_add_ there, not
bincount, which reads its maximum back to size its output). Expert ids must lie in [0, E): the entry points check
that (kernels.moe_reference.check_moe_args) unless their caller already did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertGroups:
    """A layer call's (token, slot) pairs ordered by expert.

    A pair's flat id is `t * K + k` (its position in topk_ids.reshape(-1)). Expert e's pairs are
    `sorted_ids[offsets[e]:offsets[e + 1]]`, in token order (the sort is stable); `token_ids` is
    `sorted_ids // K` (the rows of x they read), `counts[e]` how many there are. All int64, on topk_ids'
    device.
    """

    sorted_ids: torch.Tensor
    token_ids: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    top_k: int


@dataclass(frozen=True)
class BlockAlignment:
    """The Triton layout: each expert's pairs padded to a multiple of `block_m`, so every tile of
    `block_m` rows belongs to one expert.

    - `sorted_ids` int32 `[max_padded]`: flat (token, slot) ids; padding rows and everything past
      `num_padded` hold `num_rows` (= T * K, an id no pair has: the kernel masks it);
    - `block_experts` int32 `[max_padded // block_m]`: each tile's expert, -1 for tiles past the end;
    - `num_padded` int32 `[1]` on the device: rows actually used (a multiple of `block_m`); the kernel
      reads it and tiles past it return at once, so the grid is sized by `max_padded` without a sync.

    `max_padded = roundup(T * K + min(E, T * K) * (block_m - 1), block_m)`: every non-empty expert wastes
    at most block_m - 1 rows.
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_rows: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.numel()


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Group topk_ids' (token, slot) pairs by expert (see ExpertGroups); ids must lie in [0, num_experts)."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    sorted_ids = torch.argsort(flat, stable=True)
    if flat.is_cuda:
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
    else:
        # On the CPU scatter_add_ always opens a parallel region (60 ms a call on a loaded 2-core machine);
        # bincount counts on one thread, and its host read of the maximum costs nothing there.
        counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return ExpertGroups(sorted_ids=sorted_ids, token_ids=sorted_ids // top_k, counts=counts, offsets=offsets,
                        top_k=top_k)


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most rows an alignment of `num_rows` pairs over `num_experts` experts can use (BlockAlignment)."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     groups: ExpertGroups | None = None) -> BlockAlignment:
    """Pad each expert's run of pairs to a multiple of `block_m` (see BlockAlignment).

    `groups`: this call's group_by_expert result if the caller has it (the sort is not redone).
    """
    if block_m < 1:
        raise ValueError(f"align_block_size: block_m must be positive, got {block_m}")
    if groups is None:
        groups = group_by_expert(topk_ids, num_experts)
    device = topk_ids.device
    num_rows = groups.sorted_ids.numel()
    padded_counts = (groups.counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    # Pair j of the sorted order belongs to expert s = flat[sorted_ids[j]] and is the (j - offsets[s])-th
    # of its expert; it moves to that place in its expert's padded run.
    experts = topk_ids.reshape(-1).long()[groups.sorted_ids]
    rank = torch.arange(num_rows, device=device) - groups.offsets[experts]
    dest = padded_starts[experts] + rank
    max_padded = max_padded_rows(num_rows, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), num_rows, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, groups.sorted_ids.to(torch.int32))
    # The expert of the tile starting at row b * block_m is the first whose padded end lies past it
    # (right=True skips empty experts, whose end equals their predecessor's).
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    if num_experts:
        num_padded = padded_ends[-1:].to(torch.int32)
    else:
        num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    return BlockAlignment(sorted_ids=sorted_ids, block_experts=block_experts, num_padded=num_padded,
                          block_m=block_m, num_rows=num_rows)
