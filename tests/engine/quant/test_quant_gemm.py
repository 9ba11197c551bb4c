"""The quantized GEMM (kernels/cpu/quant_gemm.cpp) against the PyTorch reference of the same packed weight:
4-bit, 8-bit, e4m3 and e2m1 (MXFP4) codes; zero points, offsets and constant zeros; float16 and float32
scales; groups that do and do not divide K; K past one dequantized chunk; 1 to 70 rows; bias and per-row
activation scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu import load
from services.engine.quant.packed_weight import QuantizedWeight
from services.engine.quant.panel_weight import PanelWeight


@pytest.fixture(scope="module")
def ext():
    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)")
    if not mod.quant_gemm_supported():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    return mod


def random_weight(gen, n, k, bits, group, mode, scale_dtype, float8=False, fp4=False) -> QuantizedWeight:
    groups = -(-k // group)
    if fp4:  # every e2m1 code, power-of-two scales over a wide range (MXFP4's E8M0), no zero point
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        exps = torch.randint(-20, 6, (n, groups), generator=gen)
        return QuantizedWeight(codes, 4, group, torch.ldexp(torch.ones(n, groups), exps), fp4=True, source="test")
    if float8:
        vals = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        codes = vals.view(torch.uint8)
        # a few subnormals and zeros, which the kernel widens on a separate path
        special = torch.tensor([0, 3, 0x85], dtype=torch.uint8)[:k]
        codes[:, :special.numel()] = special
    else:
        codes = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    zero = offset = None
    if mode == "zero":
        zero = torch.randint(0, 2 ** bits, (n, groups), generator=gen, dtype=torch.uint8)
    elif mode == "offset":
        offset = (torch.randn(n, groups, generator=gen) * 0.05).to(scale_dtype)
    zero_const = 2 ** (bits - 1) if mode == "const" and not float8 else 0
    return QuantizedWeight(codes, bits, group, scale, zero=zero, zero_const=zero_const,
                           offset=offset, float8=float8, source="test")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), k=st.sampled_from([2, 30, 64, 96, 576, 1100]), m=st.sampled_from([1, 2, 5, 7, 64, 70]),
       kind=st.sampled_from(["u4", "u8", "fp8", "fp4"]), mode=st.sampled_from(["zero", "offset", "const"]),
       group=st.sampled_from([2, 16, 32, 128, 0]), scale_dtype=st.sampled_from([torch.float16, torch.float32]),
       with_bias=st.booleans(), with_row_scale=st.booleans(), seed=st.integers(0, 2 ** 31))
def test_quant_gemm_matches_the_reference(ext, n, k, m, kind, mode, group, scale_dtype, with_bias, with_row_scale,
                                          seed):
    gen = torch.Generator().manual_seed(seed)
    group = group or k + (k % 2)
    if kind == "fp8":
        mode = "const"
    qw = random_weight(gen, n, k, 4 if kind in ("u4", "fp4") else 8, group, mode, scale_dtype,
                       float8=kind == "fp8", fp4=kind == "fp4")
    pw = PanelWeight.of(qw)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) if with_bias else None
    padded = None
    if bias is not None:
        padded = torch.zeros(pw.codes.shape[0] * 64)
        padded[:n] = bias
    row_scale = torch.rand(m, generator=gen) + 0.5 if with_row_scale else None
    got = ext.quant_gemm(x, pw.codes, pw.kind, pw.group_size, pw.scale, pw.offset, pw.zero, pw.zero_const, n, padded,
                         row_scale)
    w = qw.dequantize()
    assert torch.equal(pw.dequantize(), w), "the panel layout holds the same weight"
    want = x.float() @ w.T
    bound = x.float().abs() @ w.abs().T
    if row_scale is not None:
        want, bound = want * row_scale[:, None], bound * row_scale[:, None]
    if bias is not None:
        want = want + bias
    # float32 weights (a fused multiply-add may round them one float32 ulp apart from the reference), float32
    # accumulation in another order, one rounding of the output to bfloat16
    tol = want.abs() * 2 ** -8 + bound * 2 ** -18
    assert got.shape == (m, n) and ((got.float() - want).abs() <= tol + 1e-30).all()
