"""Integers packed into int32 words, lowest bits first, as GPTQ, AWQ and compressed-tensors store them."""

from __future__ import annotations

import torch

# AutoAWQ's GEMM order: nibble i of a word holds output column 8j + AWQ_ORDER[i] of its group of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Every `bits`-bit field of each int32 word, as uint8, along `dim` (word w, field i -> index w*per + i)."""
    assert packed.dtype == torch.int32 and 32 % bits == 0 and dim in (0, 1)
    per = 32 // bits
    words = packed.view(torch.int32)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 1:
        fields = (words.unsqueeze(-1) >> shifts) & mask  # [R, W, per]
        return fields.reshape(words.shape[0], -1).to(torch.uint8)
    fields = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & mask  # [W, per, C]
    return fields.reshape(-1, words.shape[1]).to(torch.uint8)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of unpack_int32 (tests write checkpoints with it); pads `dim` to whole words with zeros."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        return pack_int32(values.T, bits, 1).T.contiguous()
    pad = (-v.shape[1]) % per
    v = torch.nn.functional.pad(v, (0, pad)).view(v.shape[0], -1, per)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(per):
        word |= (v[..., i] & ((1 << bits) - 1)) << (bits * i)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [R, C/8] -> uint8 [R, C] in logical column order."""
    fields = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)
    out = torch.empty_like(fields)
    out[..., list(AWQ_ORDER)] = fields
    return out.reshape(packed.shape[0], -1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    grouped = values.view(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return pack_int32(grouped.reshape(values.shape[0], -1), 4, 1)
