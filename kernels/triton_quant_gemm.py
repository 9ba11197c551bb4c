"""Linear layers over quantized weights on CUDA: y = x @ w.T (+ bias), w dequantized inside the kernel, never
to memory; the Triton twin of kernels/cpu/quant_gemm.cpp over the same packed layout.

Layout (services/engine/quant/panel_weight.py): codes of 64-column panels, `[panels, K/2, 64]` bytes for
4-bit kinds (the even k in the low nibble) or `[panels, K/2, 64, 2]` for 8-bit ones; scale (and offset, or
uint8 zero) `[panels, groups, 64]`. Code kinds: 0 unsigned 8-bit, 1 unsigned 4-bit, 2 e4m3 (FP8), 3 e2m1
(MXFP4). `w[n, k] = s * code + b` with b the offset, `-s * zero` or `-s * zero_const`; FP8 and FP4 codes
are decoded arithmetically to their exact float values.

One program computes a tile of BLOCK_M rows x one panel: per block of BLOCK_P pairs of k it loads the
codes once, decodes even and odd k, applies the group's scale, and accumulates two float32 dots. W8A8
checkpoints give it their quantize-dequantized activations (as the PyTorch reference does), so the
result is the reference's; FP8 tensor-core products (Hopper) are not used.

Never run on a GPU here: tested under TRITON_INTERPRET=1 in float32 (tests/kernels/test_triton_quant_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_device, device_guard, dot_precision

OP = "kernels.quant_gemm"
PANEL = 64
KINDS = (0, 1, 2, 3)  # u8, u4, fp8 (e4m3), fp4 (e2m1)


@triton.jit
def _decode(c, KIND: tl.constexpr):
    """Codes (int32) to their float32 values."""
    if KIND == 2:  # e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals m * 2^-9
        e = (c >> 3) & 15
        m = (c & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2(e.to(tl.float32) - 10.0))
        return tl.where((c & 128) != 0, -mag, mag)
    elif KIND == 3:  # e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; 0 and 0.5 below
        e = (c >> 1) & 3
        m = (c & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (2.0 + m) * tl.exp2(e.to(tl.float32) - 2.0))
        return tl.where((c & 8) != 0, -mag, mag)
    else:
        return c.to(tl.float32)


@triton.jit
def _quant_gemm_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, zero_ptr, bias_ptr, out_ptr, M, pairs, N, groups,
                       group_pairs, zero_const, stride_xm, stride_om, KIND: tl.constexpr, HAS_OFFSET: tl.constexpr,
                       HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_P: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pn = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, 64)
    row_ok = offs_m < M
    acc = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    for p0 in range(0, pairs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < pairs
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + 2 * offs_p[None, :]
        xmask = row_ok[:, None] & p_ok[None, :]
        xe = tl.load(x_rows, mask=xmask, other=0.0).to(tl.float32)
        xo = tl.load(x_rows + 1, mask=xmask, other=0.0).to(tl.float32)
        wmask = p_ok[:, None]
        if KIND == 1 or KIND == 3:
            c = tl.load(codes_ptr + (pn * pairs + offs_p[:, None]) * 64 + cols[None, :], mask=wmask, other=0)
            c = c.to(tl.int32)
            ce = c & 15
            co = c >> 4
        else:
            at = codes_ptr + (pn * pairs + offs_p[:, None]) * 128 + 2 * cols[None, :]
            ce = tl.load(at, mask=wmask, other=0).to(tl.int32)
            co = tl.load(at + 1, mask=wmask, other=0).to(tl.int32)
        g = offs_p // group_pairs
        gp = (pn * groups + g[:, None]) * 64 + cols[None, :]
        s = tl.load(scale_ptr + gp, mask=wmask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            b = tl.load(offset_ptr + gp, mask=wmask, other=0.0).to(tl.float32)
        elif HAS_ZERO:
            b = -s * tl.load(zero_ptr + gp, mask=wmask, other=0).to(tl.float32)
        else:
            b = -s * zero_const
        we = _decode(ce, KIND) * s + b
        wo = _decode(co, KIND) * s + b
        acc += tl.dot(xe, we, input_precision=PRECISION)
        acc += tl.dot(xo, wo, input_precision=PRECISION)
    out_cols = pn * 64 + cols
    col_ok = out_cols < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + out_cols, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + out_cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quant_gemm(x: torch.Tensor, codes: torch.Tensor, kind: int, group_size: int, scale: torch.Tensor,
               offset: torch.Tensor | None, zero: torch.Tensor | None, zero_const: float, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ w.T (+ bias)` in x's dtype, float32 accumulation; the arguments as the C++ `quant_gemm`
    takes them (bias: float32 padded to whole panels)."""
    check_device(OP, x)
    if kind not in KINDS:
        raise ValueError(f"{OP}: code kind {kind} is not one of {KINDS}")
    if x.dim() != 2 or codes.dim() != 3 or codes.dtype != torch.uint8 or not codes.is_contiguous():
        raise ValueError(f"{OP}: x [M, K] and contiguous uint8 codes [panels, K/2, bytes] expected")
    panels, pairs = codes.shape[0], codes.shape[1]
    if codes.shape[2] != (PANEL if kind in (1, 3) else 2 * PANEL):
        raise ValueError(f"{OP}: codes' last dimension does not match code kind {kind}")
    m, k = x.shape
    if not (pairs * 2 >= k and pairs * 2 <= k + 1) or group_size < 2 or group_size % 2:
        raise ValueError(f"{OP}: codes of {pairs} pairs do not fit K={k}, or group_size {group_size} is odd")
    if out_features > panels * PANEL or scale.shape[0] != panels or scale.shape[2] != PANEL:
        raise ValueError(f"{OP}: scale {tuple(scale.shape)} / out_features {out_features} do not fit the panels")
    if x.stride(1) != 1 or k % 2:
        padded = torch.zeros(m, pairs * 2, dtype=x.dtype, device=x.device)
        padded[:, :k] = x
        x = padded
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 32
    dummy = scale
    with device_guard(x):
        _quant_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(out_features, PANEL))](
            x, codes, scale.contiguous(), dummy if offset is None else offset.contiguous(),
            dummy if zero is None else zero.contiguous(), dummy if bias is None else bias.contiguous(), out,
            m, pairs, out_features, scale.shape[1], group_size // 2, float(zero_const), x.stride(0), out.stride(0),
            KIND=kind, HAS_OFFSET=offset is not None, HAS_ZERO=zero is not None and offset is None,
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_P=16, PRECISION=dot_precision(x.dtype),
            num_warps=4)
    return out
