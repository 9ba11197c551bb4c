"""What only the AMX prefill kernel (kernels/cpu/amx_prefill.cpp) needs beyond the tests both prefill
kernels share (test_cpu_prefill_kernels.py): the same roundings as the AVX512-BF16 kernel it stands in for,
and scores far from zero."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import load
from tests.kernels.test_cpu_prefill_kernels import _causal_float64


@pytest.fixture(scope="module")
def ext():
    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)")
    if not mod.amx_prefill_supported(64):
        pytest.skip("no AMX tiles here (CPU, build or PAGEDSERVE_CPU_AMX)")
    return mod


@pytest.mark.parametrize("n,dim", [(70, 64), (300, 64), (129, 128)])
def test_agrees_with_the_avx512_kernel(ext, n, dim):
    # Both round the probabilities to bfloat16 and keep 1/sum in float32: only the float32 sums' order differs.
    if not ext.prefill_bf16_supported(dim):
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, dim, generator=g).bfloat16() for h in (9, 3, 3))
    a, b = ext.amx_prefill(q, k, v, dim ** -0.5), ext.prefill_bf16(q, k, v, dim ** -0.5)
    assert (a.float() - b.float()).abs().max().item() <= 1e-2


def test_large_scores_stay_finite(ext):
    # Scores far from zero: the softmax subtracts each row's maximum before exp.
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(80, h, 64, generator=g).bfloat16() for h in (9, 3, 3))
    out = ext.amx_prefill(q * 30, k * 30, v, 0.125)
    want = _causal_float64(q * 30, k * 30, v, 0.125)
    assert torch.isfinite(out).all()
    assert (out.double() - want).abs().max().item() <= 5e-2 * max(1.0, want.abs().max().item())
