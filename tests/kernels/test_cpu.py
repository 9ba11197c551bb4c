"""The C++ CPU kernels (the engine's CPU fast path) against the references and float64 dense attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import decode_attention_cpu, load
from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err
from kernels.reference import decode_attention_ref


@pytest.fixture(scope="module")
def ext():
    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)")
    return mod


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dense_float64(ext, gen, head_dim, group, block_size):
    lens = [1, block_size - 1, block_size, block_size + 1, 1100]
    inp = make_paged_inputs(lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                            shared_blocks=1, poison_unused=True, generator=gen)
    out = decode_attention_cpu(*inp.decode_args())  # never reads a NaN slot past a context
    dense = dense_attention(inp)
    assert not out.isnan().any()
    assert rel_err(out, dense) <= 1e-5
    ref = decode_attention_ref(*inp.finite().decode_args())
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(ext, gen, dtype):
    inp = make_paged_inputs([5, 40, 300], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                            dtype=dtype, generator=gen)
    assert rel_err(decode_attention_cpu(*inp.decode_args()), dense_attention(inp)) <= 1e-2


def test_decode_strided_query(ext, gen):
    inp = make_paged_inputs([17, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, generator=gen)
    wide = torch.randn(2, 4, 128, generator=gen)
    wide[:, :, :64] = inp.q
    strided = wide[:, :, :64]
    assert not strided.is_contiguous()
    assert rel_err(decode_attention_cpu(strided, *inp.decode_args()[1:]), dense_attention(inp)) <= 1e-5


@pytest.fixture
def amx(ext):
    if not ext.amx_available():
        pytest.skip("this CPU or kernel offers no AMX tiles")
    previous = ext.set_amx_enabled(True)
    yield ext
    ext.set_amx_enabled(previous)


@pytest.mark.parametrize("head_dim,group,block_size", [(64, 3, 16), (64, 1, 16), (128, 8, 32), (64, 16, 16),
                                                       (128, 2, 16)])
@pytest.mark.parametrize("lens,shared_blocks", [
    ([1, 15, 16, 17, 70, 71, 259, 300, 1100], 0),
    ([1, 15, 16, 17, 70, 71, 259, 300, 1100], 1),  # a one-token context shares with everyone
    ([300, 301, 302, 303, 310, 320, 400, 401, 287, 290, 1100], 8),  # units of several sequences
], ids=["private", "short-shared", "long-shared"])
def test_amx_decode_matches_dense_and_the_avx_kernel(amx, gen, head_dim, group, block_size, lens, shared_blocks):
    inp = make_paged_inputs(lens, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                            dtype=torch.bfloat16, shared_blocks=shared_blocks, poison_unused=True, generator=gen)
    out = decode_attention_cpu(*inp.decode_args())
    assert not out.isnan().any()  # no NaN slot past a context leaks in, not even as 0 * NaN
    assert rel_err(out, dense_attention(inp)) <= 1e-2
    amx.set_amx_enabled(False)
    assert rel_err(out, decode_attention_cpu(*inp.decode_args())) <= 1e-2


def test_fused_add_rms_norm(ext, gen):
    from services.engine.layers.norms import rms_norm

    h = torch.randn(37, 576, generator=gen).bfloat16()
    d = torch.randn(37, 576, generator=gen).bfloat16()
    w = torch.randn(576, generator=gen).bfloat16()
    expect_h = h + d
    expect = rms_norm(expect_h, w, 1e-5)
    got = ext.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(h, expect_h)  # residual updated in place
    assert rel_err(got, expect) <= 1e-2
    assert rel_err(ext.add_rms_norm(h.float(), None, w.float(), 1e-5), rms_norm(h.float(), w.float(), 1e-5)) <= 1e-6


def test_fused_rope_and_silu_mul(ext, gen):
    from services.engine.layers.rotary import RopeSpec, RotaryEmbedding

    heads, kv, d, T = 4, 2, 64, 11
    rope = RotaryEmbedding(RopeSpec(10000.0, d, max_position_embeddings=256), 256, torch.device("cpu"))
    qkv = torch.randn(T, (heads + 2 * kv) * d, generator=gen)
    pos = torch.randint(0, 256, (T,), generator=gen)
    q_ref, k_ref = rope(pos, qkv[:, :heads * d].view(T, heads, d), qkv[:, heads * d:(heads + kv) * d].view(T, kv, d))
    v_before = qkv[:, (heads + kv) * d:].clone()
    ext.rope_inplace(qkv, pos, rope.cos, rope.sin, heads + kv, d)
    assert rel_err(qkv[:, :heads * d].view(T, heads, d), q_ref) <= 1e-6
    assert rel_err(qkv[:, heads * d:(heads + kv) * d].view(T, kv, d), k_ref) <= 1e-6
    assert torch.equal(qkv[:, (heads + kv) * d:], v_before)  # values are not rotated
    gu = torch.randn(T, 2 * 96, generator=gen)
    gate, up = gu.chunk(2, dim=-1)
    assert rel_err(ext.silu_mul(gu), F.silu(gate) * up) <= 1e-6


def test_fused_ops_bfloat16_vector_paths(ext, gen):
    from services.engine.layers.rotary import RopeSpec, RotaryEmbedding

    heads, kv, d, T = 9, 3, 64, 37
    rope = RotaryEmbedding(RopeSpec(10000.0, d, max_position_embeddings=2048), 2048, torch.device("cpu"))
    qkv = torch.randn(T, (heads + 2 * kv) * d, generator=gen).bfloat16()
    pos = torch.randint(0, 2048, (T,), generator=gen)
    q_ref, k_ref = rope(pos, qkv[:, :heads * d].float().view(T, heads, d),
                        qkv[:, heads * d:(heads + kv) * d].float().view(T, kv, d))
    ext.rope_inplace(qkv, pos, rope.cos, rope.sin, heads + kv, d)
    assert rel_err(qkv[:, :heads * d].view(T, heads, d), q_ref) <= 1e-2
    assert rel_err(qkv[:, heads * d:(heads + kv) * d].view(T, kv, d), k_ref) <= 1e-2
    gu = torch.randn(T, 2 * 1536, generator=gen)
    gu[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # exp overflow / underflow at the extremes
    gu = gu.bfloat16()
    gate, up = gu.float().chunk(2, dim=-1)
    got = ext.silu_mul(gu)
    assert got.isfinite().all()
    assert rel_err(got, F.silu(gate) * up) <= 1e-2


def test_write_kv_matches_the_reference_and_skips_padding(ext, gen):
    from kernels.cpu import write_kv_cpu
    from kernels.reference import write_kv_ref

    qkv = torch.randn(6, 4 * 64, generator=gen).bfloat16()  # k and v as strided views of a fused buffer
    k, v = qkv[:, 64:128].view(6, 1, 64), qkv[:, 128:192].view(6, 1, 64)
    caches = [torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([5, 63, -1, 0, 17, 40])
    write_kv_cpu(k, v, caches[0], caches[1], slots)
    write_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside the cache"):
        write_kv_cpu(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 4, 64]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_argmax_breaks_half_precision_ties_in_float32(ext, gen, dtype):
    ties = 0
    for _ in range(10):
        hidden = torch.randn(1, 96, generator=gen).to(dtype)
        weight = (torch.randn(5000, 96, generator=gen) * 0.1).to(dtype)
        weight[7] = hidden[0] * 0.5  # the clear winner ...
        weight[4000] = weight[7]
        k = int(hidden[0].float().argmax())  # ... and a rival one step higher where the hidden state is positive
        weight[4000].view(torch.int16)[k] += 1  # the next representable value up (it is positive)
        exact = hidden.float() @ weight.float().T
        logits = exact.to(dtype)
        assert exact.argmax().item() == 4000
        assert ext.argmax_rows_exact(logits, hidden, weight).item() == 4000
        ties += int(logits[0, 7] == logits[0, 4000])
    assert ties > 0  # the rounded logits did tie, so a plain argmax would have answered 7


def test_sampler_greedy_is_exact_and_independent_of_the_batch(ext, gen):
    from services.contracts.step_protocol import SamplingSpec
    from services.engine.sampler import Sampler, SampleRow

    hidden = torch.randn(8, 96, generator=gen).bfloat16()
    weight = torch.randn(3000, 96, generator=gen).bfloat16()
    logits = (hidden.float() @ weight.float().T).bfloat16()
    want = (hidden.float() @ weight.float().T).max(-1).indices.tolist()
    sampler = Sampler(torch.device("cpu"), ext.argmax_rows, ext.argmax_rows_exact)
    greedy, hot = SampleRow(SamplingSpec(temperature=0.0), 0, 0), SampleRow(SamplingSpec(temperature=1.0), 0, 0)
    alone, _ = sampler(logits, [greedy] * 8, hidden, weight)
    mixed, _ = sampler(logits, [greedy, hot] * 4, hidden, weight)
    with_logprobs, lps = sampler(logits, [SampleRow(SamplingSpec(temperature=0.0, logprobs=2), 0, 0)] * 8, hidden,
                                 weight)
    assert alone == want and mixed[0::2] == want[0::2] and with_logprobs == want
    assert all(len(lp.top_ids) == 2 for lp in lps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_rows_matches_torch_and_takes_the_first_tie(ext, gen, dtype):
    x = torch.randn(9, 3000, generator=gen).to(dtype)
    x[4] = 0
    x[4, 2500] = x[4, 1700] = 1  # a tie across chunks: the first one wins
    x[5, :] = -1
    assert ext.argmax_rows(x).tolist() == [*x[:4].float().max(-1).indices.tolist(), 1700, 0,
                                           *x[6:].float().max(-1).indices.tolist()]
