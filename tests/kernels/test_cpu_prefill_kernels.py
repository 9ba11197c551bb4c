"""The causal prefill kernels against float64 attention: AVX512-BF16 (kernels/cpu/prefill_bf16.cpp) and
AMX (kernels/cpu/amx_prefill.cpp), each where this CPU runs it, the same tests for both."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu import load


class Kernel:
    """One prefill kernel under its own name (`prefill_bf16` or `amx_prefill`), called as the module's."""

    def __init__(self, mod, name: str):
        self.mod, self.name = mod, name
        self.prefill = getattr(mod, name)
        self.supported = getattr(mod, name + "_supported")


@pytest.fixture(scope="module", params=["prefill_bf16", "amx_prefill"])
def ext(request):
    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)")
    if not getattr(mod, request.param + "_supported")(64):
        pytest.skip(f"{request.param}: this CPU (or PAGEDSERVE_CPU_AMX) offers no "
                    f"{'AMX tiles' if request.param.startswith('amx') else 'AVX512-BF16'}")
    return Kernel(mod, request.param)


def _causal_float64(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    scores = (qd @ kd.transpose(1, 2)) * scale
    n = q.shape[0]
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, -1) @ vd).transpose(0, 1)


def _check(ext, n, heads, kv_heads, dim, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # q, k and v as views of one fused qkv row, as the engine passes them
        qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
        q = qkv[:, :heads * dim].view(n, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim)
    else:
        q, k, v = (torch.randn(n, h, dim, generator=g).bfloat16() for h in (heads, kv_heads, kv_heads))
    scale = dim ** -0.5
    out = ext.prefill(q, k, v, scale)
    want = _causal_float64(q, k, v, scale)
    # bfloat16 probabilities in the second product (as flash attention rounds them) and a bfloat16 output.
    err = (out.double() - want).abs().max().item()
    assert err <= 2e-2 * max(1.0, want.abs().max().item()), err
    assert not out.isnan().any()


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 100, 513])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_matches_float64_causal_attention(ext, n, heads, kv_heads, dim):
    _check(ext, n, heads, kv_heads, dim, seed=n * 31 + heads + dim)


def test_views_of_a_fused_qkv_row(ext):
    _check(ext, 70, 9, 3, 64, seed=3, strided=True)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 200), kv_heads=st.integers(1, 3), group=st.integers(1, 4), dim=st.sampled_from([64, 128]),
       seed=st.integers(0, 2**16))
def test_any_length_and_grouping(ext, n, kv_heads, group, dim, seed):
    _check(ext, n, kv_heads * group, kv_heads, dim, seed)


@pytest.mark.parametrize("offset,n", [(1, 1), (15, 1), (100, 16), (384, 64), (7, 33), (500, 17)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128)])
def test_a_chunk_after_its_context(ext, offset, n, heads, kv_heads, dim):
    # Query i of the chunk sits at key position offset + i: the rows of full causal attention over
    # offset + n tokens that belong to the chunk.
    g = torch.Generator().manual_seed(offset * 7 + n)
    total = offset + n
    q = torch.randn(total, heads, dim, generator=g).bfloat16()
    k, v = (torch.randn(total, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
    scale = dim ** -0.5
    out = ext.prefill(q[offset:], k, v, scale, offset)
    want = _causal_float64(q, k, v, scale)[offset:]
    assert (out.double() - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item())
    with pytest.raises(RuntimeError, match="disagree"):
        ext.prefill(q[offset:], k, v, scale, offset + 1)


def test_refuses_what_it_cannot_compute(ext):
    x = torch.randn(4, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.prefill(x.float(), x.float(), x.float(), 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        y = torch.randn(4, 2, 80).bfloat16()
        ext.prefill(y, y, y, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        ext.prefill(torch.randn(4, 3, 64).bfloat16(), x, x, 0.125)
    assert not ext.supported(80)
