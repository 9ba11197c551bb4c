"""Structured output's token mask on CUDA: disallowed tokens' logits set to -inf in place, and its launcher.

Grid (rows, cdiv(vocab, BLOCK)): a program reads BLOCK / 32 words of its row's packed int32 mask and
writes -inf over the tokens whose bit is clear, leaving the allowed ones untouched (no read of logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_device, device_guard

OP = "kernels.apply_token_bitmask"
BLOCK = 4096


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, vocab, stride_logits, stride_mask, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(mask_ptr + row * stride_mask + offs // 32, mask=inside, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + offs, neg_inf, mask=inside & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Triton twin of `kernels.token_bitmask.apply_token_bitmask_ref`."""
    check_device(OP, logits)
    if logits.dim() != 2 or logits.stride(1) != 1 or bitmask.dim() != 2 or bitmask.stride(1) != 1:
        raise ValueError(f"{OP}: logits and mask must be 2-D with contiguous rows")
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"{OP}: mask must be int32 [rows, >= ceil(vocab / 32)], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} for logits {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return
    with device_guard(logits):
        _apply_token_bitmask_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK, num_warps=4)
