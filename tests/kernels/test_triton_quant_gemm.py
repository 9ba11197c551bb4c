"""The Triton quantized GEMM (kernels/triton_quant_gemm.py) under the interpreter, in float32, against the
packed weight's own dequantization: 4-bit, 8-bit, e4m3 and e2m1 codes; zero points, offsets and constant
zeros; float16 and float32 scales; groups that do and do not divide K; odd K; 1 to 40 rows; bias."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.quant.panel_weight import PanelWeight
from tests.engine.quant.test_quant_gemm import random_weight

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 130), k=st.sampled_from([2, 31, 64, 96]), m=st.sampled_from([1, 3, 17, 40]),
       kind=st.sampled_from(["u4", "u8", "fp8", "fp4"]), mode=st.sampled_from(["zero", "offset", "const"]),
       group=st.sampled_from([2, 16, 32, 0]), scale_dtype=st.sampled_from([torch.float16, torch.float32]),
       with_bias=st.booleans(), seed=st.integers(0, 2 ** 31))
def test_triton_quant_gemm_matches_the_dequantized_weight(n, k, m, kind, mode, group, scale_dtype, with_bias, seed):
    from kernels.triton_quant_gemm import quant_gemm

    gen = torch.Generator().manual_seed(seed)
    group = group or k + (k % 2)
    if kind in ("fp8", "fp4"):
        mode = "const"
    qw = random_weight(gen, n, k, 4 if kind in ("u4", "fp4") else 8, group, mode, scale_dtype,
                       float8=kind == "fp8", fp4=kind == "fp4")
    pw = PanelWeight.of(qw)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    padded = None
    if bias is not None:
        padded = torch.zeros(pw.codes.shape[0] * 64)
        padded[:n] = bias
    got = quant_gemm(x, pw.codes, pw.kind, pw.group_size, pw.scale, pw.offset, pw.zero, pw.zero_const, n, padded)
    w = pw.dequantize()
    want = x @ w.T + (0 if bias is None else bias)
    # The kernel forms s * code + b where the reference forms (code - zero) * s: each weight may differ by an
    # ulp of its larger term; then float32 products summed in another order.
    b = PanelWeight.of(replace(qw, codes=torch.zeros_like(qw.codes))).dequantize().abs()
    bound = x.abs() @ (w.abs() + 2 * b).T + (0 if bias is None else bias.abs())
    assert got.shape == (m, n) and ((got - want).abs() <= bound * 2 ** -19 + 1e-30).all()


def test_refuses_what_does_not_fit():
    from kernels.triton_quant_gemm import quant_gemm

    codes = torch.zeros(1, 8, 64, dtype=torch.uint8)
    scale = torch.ones(1, 1, 64)
    with pytest.raises(ValueError, match="code kind"):
        quant_gemm(torch.zeros(2, 16), codes, 7, 16, scale, None, None, 0, 64)
    with pytest.raises(ValueError, match="do not fit K"):
        quant_gemm(torch.zeros(2, 40), codes, 1, 16, scale, None, None, 0, 64)
    with pytest.raises(ValueError, match="last dimension"):
        quant_gemm(torch.zeros(2, 16), codes, 0, 16, scale, None, None, 0, 64)
