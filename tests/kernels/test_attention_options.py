"""Sliding windows, logit soft-capping and attention sinks in every attention backend: the PyTorch
references, the C++ decode kernel (and the CPU prefill routes built on it), and the Triton kernels under
the interpreter, each against float64 dense attention (sinks also through PagedAttention, FP8 cache
included, and the reference's against transformers' gpt_oss). Cache slots no query's window reaches are
NaN, so a kernel that reads before its window fails."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err, slots_of
from kernels.reference import causal_mask

OPTIONS = [(5, None), (None, 3.0), (7, 2.0), (64, None)]  # window, softcap (64: wider than any context)


def _decode_inputs(gen, window, block_size=4, poison=True, dtype=torch.float32):
    # Contexts shorter than, equal to and much longer than the window, one not block-aligned.
    return make_paged_inputs([1, 5, 9, 30, 47], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size,
                             dtype=dtype, poison_unused=poison, window=window, generator=gen)


def _prefill_inputs(gen, window, block_size=4, poison=True, dtype=torch.float32):
    # (context, new tokens): a whole prompt past the window, chunks after cached blocks, a decode token.
    seqs = [(23, 23), (30, 6), (9, 9), (17, 1), (41, 16)]
    return make_paged_inputs([c for c, _ in seqs], [n for _, n in seqs], num_q_heads=4, num_kv_heads=2, head_dim=32,
                             block_size=block_size, dtype=dtype, poison_unused=poison, window=window, generator=gen)


@pytest.mark.parametrize("window,softcap", OPTIONS)
def test_references_match_dense(gen, window, softcap):
    inp = _decode_inputs(gen, window).finite()
    out = kernels.decode_attention_ref(*inp.decode_args(), window=window, softcap=softcap)
    assert rel_err(out, dense_attention(inp.finite(), window, softcap)) <= 1e-5
    inp = _prefill_inputs(gen, window).finite()
    out = kernels.prefill_attention_ref(*inp.prefill_args(), window=window, softcap=softcap)
    assert rel_err(out, dense_attention(inp.finite(), window, softcap)) <= 1e-5


def test_options_change_the_answer(gen):
    """The options are not no-ops on these inputs (so the tests above could fail)."""
    inp = _prefill_inputs(gen, None).finite()
    plain = dense_attention(inp)
    assert rel_err(dense_attention(inp, window=5), plain) > 1e-2
    assert rel_err(dense_attention(inp, softcap=2.0), plain) > 1e-2


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel(gen, window, softcap, dtype):
    from kernels.cpu import decode_attention_cpu, load

    if load() is None:
        pytest.skip("no C++ compiler here")
    inp = _decode_inputs(gen, window, dtype=dtype)
    out = decode_attention_cpu(*inp.decode_args(), window=window, softcap=softcap)
    assert not out.isnan().any(), "read a slot outside the window"
    assert rel_err(out, dense_attention(inp.finite(), window, softcap)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill(gen, window, softcap, dtype):
    """The CPU backend's prefill: every new token through the C++ decode kernel in bfloat16, the reference
    in float32 (the caches here hold every position, as the engine writes them before attending)."""
    from services.engine.cpu_prefill import prefill_attention_cpu

    inp = _prefill_inputs(gen, window, dtype=dtype, poison=dtype == torch.bfloat16)
    starts, lens = inp.query_start_loc.tolist(), inp.context_lens.tolist()
    spans = [(starts[i], starts[i + 1], lens[i]) for i in range(len(lens))]
    out = prefill_attention_cpu(inp.q, None, None, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale, {},
                                window=window, softcap=softcap)
    assert not out.isnan().any(), "read a slot outside the window"
    assert rel_err(out, dense_attention(inp.finite(), window, softcap)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("window,softcap", OPTIONS)
def test_triton_decode(gen, poisoned, window, softcap):
    pytest.importorskip("triton")
    from kernels import triton_decode

    inp = _decode_inputs(gen, window, block_size=16)
    for splits in (1, 3):  # one program per sequence, and a window divided among split-KV programs
        out = triton_decode.decode_attention(*inp.decode_args(), window=window, softcap=softcap, num_splits=splits,
                                             min_split_tokens=4, tile_n=16)
        assert not out.isnan().any(), "read a slot outside the window"
        assert rel_err(out, dense_attention(inp.finite(), window, softcap)) <= 1e-5


@pytest.mark.parametrize("window,softcap", OPTIONS)
def test_triton_prefill(gen, poisoned, window, softcap):
    pytest.importorskip("triton")
    from kernels import triton_prefill

    inp = _prefill_inputs(gen, window, block_size=16)
    out = triton_prefill.prefill_attention(*inp.prefill_args(), window=window, softcap=softcap, block_m=16,
                                           tile_n=16)
    assert not out.isnan().any(), "read a slot outside the window"
    assert rel_err(out, dense_attention(inp.finite(), window, softcap)) <= 1e-5


@pytest.mark.parametrize("bad", [{"window": 0}, {"window": -3}, {"window": 2.5}, {"window": True},
                                 {"softcap": 0.0}, {"softcap": -1.0}])
def test_bad_options_are_refused_by_name(gen, bad):
    inp = _decode_inputs(gen, None).finite()
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        kernels.decode_attention_ref(*inp.decode_args(), **bad)
    with pytest.raises(ValueError, match=name):
        kernels.prefill_attention_ref(*_prefill_inputs(gen, None).finite().prefill_args(), **bad)


def test_random_windows_and_lengths_match_dense(gen):
    """Generated cases: any window against any mix of context lengths and chunks (reference and C++)."""
    from kernels.cpu import decode_attention_cpu

    rng = random.Random(gen.initial_seed())
    for _ in range(10):
        ctx = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
        window = rng.randint(1, 45)
        softcap = rng.choice([None, rng.uniform(0.5, 5.0)])
        inp = make_paged_inputs(ctx, num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=rng.choice([2, 4, 8]),
                                poison_unused=True, window=window, generator=gen)
        want = dense_attention(inp.finite(), window, softcap)
        assert rel_err(decode_attention_cpu(*inp.decode_args(), window=window, softcap=softcap), want) <= 1e-5
        assert rel_err(kernels.decode_attention_ref(*inp.finite().decode_args(), window=window, softcap=softcap),
                       want) <= 1e-5


# Attention sinks (gpt-oss): one float32 logit per query head in each softmax's denominator, no value.
# (window, softcap) they are checked with; 64 is wider than any context here.
SINK_OPTIONS = [(None, None), (5, None), (20, None), (7, 2.0), (64, None)]


def _sinks(gen, heads: int = 4) -> torch.Tensor:
    # Logits the size of the scores (scaled q.k ~ N(0, 1)) and above: each takes a real share of the mass.
    return (torch.randn(heads, generator=gen) * 1.5 + 1.0).float()


def _want(inp, window, softcap, sinks) -> torch.Tensor:
    """Dense float64 attention with the sinks, after checking that they change it (else no test could fail)."""
    want = dense_attention(inp.finite(), window, softcap, sinks)
    assert rel_err(dense_attention(inp.finite(), window, softcap), want) > 1e-2, "the sinks change nothing here"
    return want


@pytest.mark.parametrize("window,softcap", SINK_OPTIONS)
def test_reference_sinks_match_dense(gen, window, softcap):
    sinks = _sinks(gen)
    inp = _decode_inputs(gen, window).finite()
    out = kernels.decode_attention_ref(*inp.decode_args(), window=window, softcap=softcap, sinks=sinks)
    assert rel_err(out, _want(inp, window, softcap, sinks)) <= 1e-5
    inp = _prefill_inputs(gen, window).finite()
    out = kernels.prefill_attention_ref(*inp.prefill_args(), window=window, softcap=softcap, sinks=sinks)
    assert rel_err(out, _want(inp, window, softcap, sinks)) <= 1e-5


def _dense_kv(inp, s: int):
    """Sequence s's keys and values in position order, [1, kv_heads, ctx, head_dim]."""
    ctx = int(inp.context_lens[s])
    slots = slots_of(inp.block_tables[s:s + 1], [ctx], inp.k_cache.shape[1])
    heads, dim = inp.k_cache.shape[2], inp.k_cache.shape[3]
    return tuple(c.view(-1, heads, dim)[slots].transpose(0, 1)[None] for c in (inp.k_cache, inp.v_cache))


@pytest.mark.parametrize("window", [None, 6])
def test_reference_sinks_are_transformers_gpt_oss(gen, window):
    """The definition is transformers' gpt_oss eager attention (the sink as a logit column, dropped after the
    softmax), on random tensors: whole prompts and chunks after a cached context, GQA, causal and sliding."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    inp = _prefill_inputs(gen, window).finite()
    sinks = _sinks(gen)
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    ours = kernels.prefill_attention_ref(*inp.prefill_args(), window=window, sinks=sinks)
    starts, lens = inp.query_start_loc.tolist(), inp.context_lens.tolist()
    for s, ctx in enumerate(lens):
        q = inp.q[starts[s]:starts[s + 1]].transpose(0, 1)[None]  # [1, heads, q_len, dim]
        k, v = _dense_kv(inp, s)
        visible, _ = causal_mask(ctx - q.shape[2], q.shape[2], window, "cpu")
        if visible is None:
            visible = torch.ones(q.shape[2], ctx, dtype=torch.bool).tril()
        additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        theirs, _ = eager_attention_forward(module, q, k, v, additive, inp.scale)
        assert rel_err(ours[starts[s]:starts[s + 1]], theirs[0]) <= 1e-5


@pytest.mark.parametrize("window,softcap", SINK_OPTIONS)
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 32), (torch.float32, 64), (torch.float32, 24),
                                            (torch.bfloat16, 64), (torch.bfloat16, 32)])
def test_cpu_decode_kernel_sinks(gen, window, softcap, dtype, head_dim):
    """Every C++ decode path this CPU can take: AVX-512 float32 (register-resident at D=64, G=2; the general
    one at D=32), the portable loop (D=24), AVX512-BF16 (bfloat16, D=64, no window or soft-cap) and the
    generic kernel in bfloat16 otherwise."""
    from kernels.cpu import decode_attention_cpu, load

    if load() is None:
        pytest.skip("no C++ compiler here")
    sinks = _sinks(gen)
    inp = make_paged_inputs([1, 5, 9, 30, 47], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=4,
                            dtype=dtype, poison_unused=True, window=window, generator=gen)
    out = decode_attention_cpu(*inp.decode_args(), window=window, softcap=softcap, sinks=sinks)
    assert not out.isnan().any(), "read a slot outside the window"
    assert rel_err(out, _want(inp, window, softcap, sinks)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("window,softcap", SINK_OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_sinks(gen, window, softcap, dtype):
    """float32: flash attention rescaled by its log-sum-exp (the reference where there is a soft-cap);
    bfloat16: every new token through the C++ decode kernel."""
    from services.engine.cpu_prefill import prefill_attention_cpu

    sinks = _sinks(gen)
    inp = _prefill_inputs(gen, window, dtype=dtype, poison=dtype == torch.bfloat16)
    starts, lens = inp.query_start_loc.tolist(), inp.context_lens.tolist()
    spans = [(starts[i], starts[i + 1], lens[i]) for i in range(len(lens))]
    out = prefill_attention_cpu(inp.q, None, None, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale, {},
                                window=window, softcap=softcap, sinks=sinks)
    assert not out.isnan().any(), "read a slot outside the window"
    assert rel_err(out, _want(inp, window, softcap, sinks)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("window,softcap", SINK_OPTIONS)
def test_triton_decode_sinks(gen, poisoned, window, softcap):
    """The sink joins each head's softmax once however the context is split (split 0 carries it)."""
    pytest.importorskip("triton")
    from kernels import triton_decode

    sinks = _sinks(gen)
    inp = _decode_inputs(gen, window, block_size=16)
    want = _want(inp, window, softcap, sinks)
    for splits in (1, 2, 4):
        out = triton_decode.decode_attention(*inp.decode_args(), window=window, softcap=softcap, sinks=sinks,
                                             num_splits=splits, min_split_tokens=4, tile_n=16)
        assert not out.isnan().any(), "read a slot outside the window"
        assert rel_err(out, want) <= 1e-5, f"{splits} splits"


@pytest.mark.parametrize("window,softcap", SINK_OPTIONS)
def test_triton_prefill_sinks(gen, poisoned, window, softcap):
    pytest.importorskip("triton")
    from kernels import triton_prefill

    sinks = _sinks(gen)
    inp = _prefill_inputs(gen, window, block_size=16)
    out = triton_prefill.prefill_attention(*inp.prefill_args(), window=window, softcap=softcap, sinks=sinks,
                                           block_m=16, tile_n=16)
    assert not out.isnan().any(), "read a slot outside the window"
    assert rel_err(out, _want(inp, window, softcap, sinks)) <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_attention_passes_sinks_on_every_backend(gen, backend, fp8):
    """PagedAttention with sinks and a window over a mixed batch (decodes, a whole prompt, a chunk after a
    cached context), its own cache or an FP8 one with per-tensor scales."""
    from services.engine.attention import AttentionMetadata, PagedAttention
    from services.engine.kv_cache_fp8 import to_fp8

    if backend == "triton":
        pytest.importorskip("triton")
    window, sinks = 8, _sinks(gen)
    seqs = [(9, 1), (30, 1), (23, 23), (17, 5)]  # decodes first, as the engine lays out a step
    inp = make_paged_inputs([c for c, _ in seqs], [n for _, n in seqs], num_q_heads=4, num_kv_heads=2, head_dim=32,
                            block_size=16, generator=gen)
    kv_scales = None
    if fp8:  # the cache holds e4m3(k / k_scale); attention reads e4m3 * k_scale
        kv_scales = (0.5, 2.0)
        k8, v8 = to_fp8(inp.k_cache, 1.0), to_fp8(inp.v_cache, 1.0)
        inp = dataclasses.replace(inp, k_cache=k8.float() * kv_scales[0], v_cache=v8.float() * kv_scales[1])
    starts, lens = inp.query_start_loc.tolist(), inp.context_lens.tolist()
    firsts = [c - n for c, n in seqs]
    slots = torch.cat([slots_of(inp.block_tables[s:s + 1], [lens[s]], 16, [firsts[s]]) for s in range(len(seqs))])
    heads, dim = inp.k_cache.shape[2], inp.k_cache.shape[3]
    k, v = (c.view(-1, heads, dim)[slots] for c in (inp.k_cache, inp.v_cache))  # what the step writes again
    k_cache, v_cache = (k8.clone(), v8.clone()) if fp8 else (inp.k_cache.clone(), inp.v_cache.clone())
    nd = 2
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode=nd, decode_block_tables=inp.block_tables[:nd],
        decode_context_lens=inp.context_lens[:nd], decode_max_context_len=max(lens[:nd]), decode_num_splits=None,
        prefill_block_tables=inp.block_tables[nd:],
        prefill_query_start_loc=inp.query_start_loc[nd:] - starts[nd], prefill_context_lens=inp.context_lens[nd:],
        prefill_max_query_len=max(n for _, n in seqs[nd:]), prefill_max_context_len=max(lens[nd:]),
        prefill_spans=[(starts[s] - starts[nd], starts[s + 1] - starts[nd], lens[s]) for s in range(nd, len(seqs))],
        step_cache={})
    attention = PagedAttention(backend, torch.device("cpu"))
    out = attention(inp.q, k, v, k_cache, v_cache, meta, inp.scale, kv_scales=kv_scales, window=window, sinks=sinks)
    assert rel_err(out, _want(inp, window, None, sinks)) <= 1e-5


@pytest.mark.parametrize("bad,error", [(torch.zeros(3), ValueError), (torch.zeros(4, 1), ValueError),
                                       (torch.zeros(4, dtype=torch.float16), TypeError), ([0.0] * 4, TypeError),
                                       (torch.zeros(8)[::2], ValueError)])
def test_bad_sinks_are_refused_by_name(gen, bad, error):
    from kernels.cpu import decode_attention_cpu

    inp = _decode_inputs(gen, None).finite()
    with pytest.raises(error, match="sinks"):
        kernels.decode_attention_ref(*inp.decode_args(), sinks=bad)
    with pytest.raises(error, match="sinks"):
        decode_attention_cpu(*inp.decode_args(), sinks=bad)
    with pytest.raises(error, match="sinks"):
        kernels.prefill_attention_ref(*_prefill_inputs(gen, None).finite().prefill_args(), sinks=bad)
