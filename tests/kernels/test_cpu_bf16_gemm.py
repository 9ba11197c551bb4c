"""The AVX512-BF16 GEMM (kernels/cpu/bf16_gemm.cpp) against float32 products of the same bfloat16 inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu import load


@pytest.fixture(scope="module")
def ext():
    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)")
    if not mod.bf16_gemm_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    return mod


def _product(ext, x, w, bias=None):
    packed = ext.bf16_gemm_pack(w)
    padded_bias = None
    if bias is not None:
        padded_bias = torch.zeros(packed.shape[0] * packed.shape[2])
        padded_bias[:w.shape[0]] = bias.float()
    return ext.bf16_gemm(x, packed, w.shape[0], padded_bias)


def _check(got, x, w, bias=None):
    want = x.float() @ w.float().T + (bias.float() if bias is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # float32 accumulation and one rounding to bfloat16 at the end: within bfloat16's half ulp, plus the
    # reassociation of a float32 sum of K products, bounded by the sum of their magnitudes.
    tol = want.abs() * 2 ** -8 + (x.float().abs() @ w.float().abs().T) * 2 ** -14
    assert ((got.float() - want).abs() <= tol + 1e-30).all()


@pytest.mark.parametrize("m", [0, 1, 5, 6, 7, 64, 97, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 2), (130, 33), (1, 1), (17, 64)])
def test_matches_float32_products(ext, m, n, k):
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    _check(_product(ext, x, w), x, w)


def test_bias_is_added_in_float32(ext):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 40, generator=g).bfloat16(), torch.randn(70, 40, generator=g).bfloat16()
    bias = torch.randn(70, generator=g).bfloat16()
    _check(_product(ext, x, w, bias), x, w, bias)


def test_strided_rows_and_views(ext):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(12, 200, generator=g).bfloat16()
    w = torch.randn(96, 64, generator=g).bfloat16()
    column_major = torch.randn(64, 12, generator=g).bfloat16().t()
    for x in (base[:, 10:74], base[::2, :64], column_major):
        _check(_product(ext, x, w), x, w)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 40), n=st.integers(1, 200), k=st.integers(1, 130), seed=st.integers(0, 2**16))
def test_any_shape(ext, m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    _check(_product(ext, x, w), x, w)


def test_refuses_what_it_cannot_compute(ext):
    w = torch.randn(64, 32).bfloat16()
    packed = ext.bf16_gemm_pack(w)
    with pytest.raises(RuntimeError, match="K"):
        ext.bf16_gemm(torch.randn(4, 48).bfloat16(), packed, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16_gemm(torch.randn(4, 32), packed, 64, None)
    with pytest.raises(RuntimeError, match="out_features"):
        ext.bf16_gemm(torch.randn(4, 32).bfloat16(), packed, 65, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.bf16_gemm(torch.randn(4, 32).bfloat16(), packed, 64, torch.zeros(64).bfloat16())
