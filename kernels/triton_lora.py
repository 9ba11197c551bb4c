"""LoRA's shrink and expand on CUDA for one step's tokens of mixed adapters (Punica/S-LoRA's BGMV), and the
launcher.

Each token carries its adapter's slot in a device tensor (-1: the base model). Shrink: one program per
token computes `xa = x @ A[slot]^T` over the slot's padded rank for every part of a fused projection;
expand: one program per (token, tile of outputs) adds `scale[slot] * xa_part @ B[slot][part rows]^T`
into the projection's output in place. Base-model tokens mask every load and store, so they cost a
launch slot and nothing else. The slot buffers have fixed shapes and the per-token slots live on the
device, so nothing is read back to the host and a captured CUDA graph stays valid whichever adapters are
resident. Products are summed in float32 (`tl.sum` of broadcast products, not `tl.dot`: a decode step
has one row per token, below `tl.dot`'s 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_device, device_guard, next_pow2

OP = "kernels.lora_apply"
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, xa_ptr, K, R, stride_x, stride_a_slot, stride_a_row, stride_xa,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    rows = tl.where(slot >= 0, R, 0)  # a base-model token: every access masked off
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + s * stride_a_slot + offs_r[:, None] * stride_a_row + offs_k[None, :],
                    mask=(offs_r[:, None] < rows) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(xa_ptr + t * stride_xa + offs_r, acc, mask=offs_r < rows)


@triton.jit
def _lora_expand_kernel(xa_ptr, b_ptr, slot_ptr, scale_ptr, out_ptr, N, R, r_off, row_off, stride_xa,
                        stride_b_slot, stride_b_row, stride_out, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    cols = tl.where(slot >= 0, N, 0)  # a base-model token: every access masked off
    ranks = tl.where(slot >= 0, R, 0)
    offs_r = tl.arange(0, BLOCK_R)
    xa = tl.load(xa_ptr + t * stride_xa + r_off + offs_r, mask=offs_r < ranks, other=0.0)
    b = tl.load(b_ptr + s * stride_b_slot + (row_off + offs_n)[:, None] * stride_b_row + offs_r[None, :],
                mask=(offs_n[:, None] < cols) & (offs_r[None, :] < R), other=0.0).to(tl.float32)
    delta = tl.sum(b * xa[None, :], axis=1) * tl.load(scale_ptr + s)
    where = out_ptr + t * stride_out + row_off + offs_n
    inside = offs_n < cols
    old = tl.load(where, mask=inside, other=0.0)
    tl.store(where, (old.to(tl.float32) + delta).to(old.dtype), mask=inside)


def lora_apply(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
               scales: torch.Tensor, parts: list[tuple[int, int]], max_rank: int) -> None:
    """out[t] += scale[s] * B[s](A[s](x[t])) for every token t whose slot s = token_slots[t] >= 0, in place.

    x [T, K]; out [T, sum of part sizes]; a [slots, len(parts) * max_rank, K] (part j's rows at
    j * max_rank); b [slots, sum of part sizes, max_rank]; token_slots int32 [T]; scales float32 [slots].
    Triton twin of `services.engine.lora.batch.LoraBatch.apply`'s torch path.
    """
    check_device(OP, x)
    tokens, k = x.shape
    if tokens == 0:
        return
    if x.stride(1) != 1 or out.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError(f"{OP}: x, out, a and b need contiguous rows")
    if token_slots.dtype != torch.int32 or token_slots.numel() < tokens or scales.dtype != torch.float32:
        raise ValueError(f"{OP}: token_slots must be int32 with a slot per token and scales float32")
    rank_total = len(parts) * max_rank
    if a.shape[1] != rank_total or a.shape[2] != k or b.shape[2] != max_rank:
        raise ValueError(f"{OP}: a {tuple(a.shape)} / b {tuple(b.shape)} do not fit {len(parts)} part(s) of "
                         f"rank {max_rank} over {k} inputs")
    xa = torch.empty(tokens, rank_total, dtype=torch.float32, device=x.device)
    with device_guard(x):
        _lora_shrink_kernel[(tokens,)](x, a, token_slots, xa, k, rank_total, x.stride(0), a.stride(0), a.stride(1),
                                       xa.stride(0), BLOCK_K=BLOCK_K, BLOCK_R=next_pow2(rank_total), num_warps=4)
        for j, (off, size) in enumerate(parts):
            _lora_expand_kernel[(tokens, triton.cdiv(size, BLOCK_N))](
                xa, b, token_slots, scales, out, size, max_rank, j * max_rank, off, xa.stride(0), b.stride(0),
                b.stride(1), out.stride(0), BLOCK_N=BLOCK_N, BLOCK_R=next_pow2(max_rank), num_warps=4)
