"""Scatter new tokens' keys and values into their paged-cache slots, and its launcher.

Grid (num_tokens,): a program copies one token's `[num_kv_heads, head_dim]` key and value to slot
`block_id * block_size + offset`. Slot -1 marks padding: that program returns without storing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import check_slots, check_strides, check_write_kv
from kernels.triton_common import check_device, device_guard, next_pow2

OP = "kernels.write_kv"


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding
        return
    block_id = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kcb + row * stride_kct + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + block_id * stride_vcb + row * stride_vct + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, slots_checked: bool = False) -> None:
    """Triton twin of `write_kv_ref`.

    `slots_checked`: the caller has checked every slot on the host (the engine does, with the step),
    so the launch reads nothing back from the device (no sync, CUDA-graph safe). Otherwise the slot
    range is read once and checked.
    """
    check_write_kv(OP, k, v, k_cache, v_cache, slot_mapping)
    check_device(OP, k)
    check_strides(OP, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens = slot_mapping.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_tokens == 0 or k.numel() == 0:
        return
    if not slots_checked:
        # One host read: a slot outside the cache would be a silent out-of-bounds write.
        min_slot, max_slot = torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist()
        check_slots(OP, min_slot, max_slot, k_cache)
    with device_guard(k):
        _write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(num_kv_heads),
            BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=block_size, num_warps=4,
        )
