"""Sliding windows and logit soft-capping in every attention backend: the PyTorch references, the C++
decode kernel (and the CPU prefill routes built on it), and the Triton kernels under the interpreter,
each against float64 dense attention. Cache slots no query's window reaches are NaN, so a kernel that
reads before its window fails."""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err

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
