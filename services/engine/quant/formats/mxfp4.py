"""MXFP4 (OCP microscaling FP4), as gpt-oss stores its experts: e2m1 values in blocks of 32 sharing one
power-of-two scale.

On disk (`quant_method: mxfp4`, transformers' Mxfp4 layout), per fused expert tensor `experts.{name}`:
- `{name}_blocks` uint8 `[E, N, K/32, 16]`: the 32 codes of one block in 16 bytes, the even column in the
  low nibble and the odd one in the high nibble;
- `{name}_scales` uint8 `[E, N, K/32]`: E8M0 exponents, the block's scale being 2^(s - 127).

A code is sign (bit 3), exponent (bits 1-2) and mantissa (bit 0): the magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6. So `w[n, k] = FP4[code[n, k]] * 2^(s[n, k // 32] - 127)`, the product transformers' dequantizer
(`convert_moe_packed_tensors`, ldexp of a lookup) computes. Rows N are the outputs: gate_up's 2I rows
alternate gate and up (gpt-oss's interleaving), down's are the hidden size.

Read into a `QuantizedWeight` with `fp4=True` (4-bit codes, one float32 scale per 32 columns), which the
CPU GEMM (kernels/cpu/quant_gemm.cpp, code kind fp4) decodes inside the kernel: the experts stay at 4.25
bits per weight in memory. `encode` is the inverse, used to write checkpoints in this exact format.
"""

from __future__ import annotations

import torch

from services.engine.quant.packed_weight import FP4_VALUES, QuantizedWeight, fp4_lookup

BLOCK = 32
NAN_EXPONENT = 255  # E8M0's one reserved code


def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """`[N, K/32, 16]` packed bytes -> `[N, K]` codes, one per byte (low nibble first)."""
    n = blocks.shape[0]
    flat = blocks.reshape(n, -1)
    return torch.stack([flat & 0xF, flat >> 4], dim=-1).reshape(n, -1).contiguous()


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents -> float32 2^(s - 127), as transformers' ldexp computes them (255 overflows to inf
    there as here)."""
    return torch.ldexp(torch.ones(scales.shape, dtype=torch.float32), scales.to(torch.int32) - 127)


def read_expert(blocks: torch.Tensor, scales: torch.Tensor, source: str) -> QuantizedWeight:
    """One expert's `[N, K/32, 16]` blocks and `[N, K/32]` scales as a QuantizedWeight `[N, K]`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{source}: MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 3 or blocks.shape[2] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:2]):
        raise ValueError(f"{source}: expected blocks [N, K/32, 16] and scales [N, K/32]; got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    if bool((scales == NAN_EXPONENT).any()):
        # transformers' ldexp turns it into inf weights; the OCP MX spec says the block is NaN. Either way
        # no finite weight is stored there, so the checkpoint is refused rather than served as infinities.
        rows = sorted({int(r) for r in (scales == NAN_EXPONENT).nonzero()[:, 0][:8]})
        raise ValueError(f"{source}: MXFP4 scale exponent {NAN_EXPONENT} (NaN in the OCP MX spec) in rows {rows}")
    return QuantizedWeight(unpack_codes(blocks), 4, BLOCK, block_scales(scales), fp4=True, source=source)


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight `[..., N, K]` (K a multiple of 32) -> (blocks `[..., N, K/32, 16]`, scales
    `[..., N, K/32]`): each block's scale is the power of two that brings its largest magnitude to at most
    6, each value rounded to the nearest e2m1 (a tie to the smaller magnitude). What a checkpoint writer
    would store; the tests write their MXFP4 checkpoints with it."""
    *lead, n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the input size to be a multiple of {BLOCK}; got {k}")
    x = w.float().reshape(-1, k // BLOCK, BLOCK)
    top = x.abs().amax(dim=-1, keepdim=True)
    # The smallest power of two p with top / 2^p <= 6 (E8M0 exponents 0..254).
    e = torch.ceil(torch.log2(torch.where(top > 0, top / 6.0, torch.ones_like(top)))).clamp(-127, 127)
    q = x / torch.ldexp(torch.ones_like(e), e.int())
    mags = torch.tensor(FP4_VALUES[:8])
    dist = (q.abs().unsqueeze(-1) - mags).abs()
    best = torch.argmin(dist, dim=-1).to(torch.uint8)
    codes = best | ((q < 0).to(torch.uint8) << 3)
    codes = torch.where(best == 0, torch.zeros_like(codes), codes)  # no negative zero
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(*lead, n, k // BLOCK, BLOCK // 2)
    scales = (e.squeeze(-1) + 127).to(torch.uint8).reshape(*lead, n, k // BLOCK)
    return packed.contiguous(), scales.contiguous()


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(blocks `[..., N, K/32, 16]`, scales `[..., N, K/32]`) -> float32 `[..., N, K]`."""
    *lead, n, g, _ = blocks.shape
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).reshape(*lead, n, g, BLOCK)
    values = fp4_lookup(codes) * block_scales(scales).unsqueeze(-1)
    return values.reshape(*lead, n, g * BLOCK)
