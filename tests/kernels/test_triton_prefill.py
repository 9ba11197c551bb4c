"""Triton chunked-prefill attention (interpreter, float32) against the reference and float64 dense math."""

import random

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import triton_decode, triton_prefill  # noqa: E402
from kernels.paged_inputs import PagedInputs, dense_attention, make_paged_inputs, rel_err  # noqa: E402

TOL = 1e-5


def run_prefill(inputs: PagedInputs, **knobs):
    """(Triton output, reference output on the NaN-free cache, float64 dense attention)."""
    out = triton_prefill.prefill_attention(*inputs.prefill_args(), **knobs)
    return out, kernels.prefill_attention_ref(*inputs.finite().prefill_args()), dense_attention(inputs)


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_mixed_batch(gen, poisoned, head_dim, block_size, gqa, assert_attention_close):
    rnd = random.Random(gen.initial_seed())
    ctx_random = rnd.randint(2, 3 * block_size)
    # (context_len, new tokens): a first token, a whole prompt, chunks over cached blocks, a decode
    # token, an idle sequence, and a random chunk.
    seqs = [(1, 1), (block_size - 1, block_size - 1), (block_size, 3), (block_size + 1, 1), (5, 0),
            (ctx_random, rnd.randint(1, ctx_random))]
    inputs = make_paged_inputs([c for c, _ in seqs], [n for _, n in seqs], num_q_heads=2 * gqa,
                               num_kv_heads=2, head_dim=head_dim, block_size=block_size, shared_blocks=1,
                               poison_unused=True, generator=gen)
    assert_attention_close(*run_prefill(inputs), inputs.q)


@pytest.mark.parametrize("block_m,tile_n", [(None, 64), (16, 16), (64, 32)])
def test_prefill_long_context(gen, poisoned, block_m, tile_n, assert_attention_close):
    rnd = random.Random(gen.initial_seed())
    ctx = rnd.randint(1001, 1200)
    seqs = [(ctx, rnd.randint(20, 40)), (rnd.randint(40, 70), 40)]
    inputs = make_paged_inputs([c for c, _ in seqs], [n for _, n in seqs], num_q_heads=3, num_kv_heads=1,
                               head_dim=64, block_size=16, shared_blocks=2, poison_unused=True, generator=gen)
    assert_attention_close(*run_prefill(inputs, block_m=block_m, tile_n=tile_n), inputs.q)


def test_prefill_serves_decode(gen, poisoned, assert_attention_close):
    # A batch of one new token per sequence is decode: both kernels and the decode reference agree.
    inputs = make_paged_inputs([1, 15, 16, 17, 90], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                               poison_unused=True, generator=gen)
    assert_attention_close(*run_prefill(inputs), inputs.q)
    via_prefill = triton_prefill.prefill_attention(*inputs.prefill_args())
    via_decode = triton_decode.decode_attention(*inputs.decode_args())
    assert rel_err(via_prefill, via_decode) <= TOL


def test_prefill_public_entry_point(gen, poisoned):
    inputs = make_paged_inputs([40, 9], [24, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               generator=gen)
    out = kernels.prefill_attention(*inputs.prefill_args())
    assert rel_err(out, dense_attention(inputs)) <= TOL


def test_prefill_no_tokens():
    inputs = make_paged_inputs([4, 0], [0, 0], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    assert kernels.prefill_attention(*inputs.prefill_args()).shape == (0, 4, 64)
    assert kernels.prefill_attention_ref(*inputs.prefill_args()).shape == (0, 4, 64)


def test_prefill_float16(gen, poisoned):
    inputs = make_paged_inputs([1, 31, 300], [1, 31, 40], num_q_heads=6, num_kv_heads=2, head_dim=64,
                               block_size=16, dtype=torch.float16, generator=gen)
    out = triton_prefill.prefill_attention(*inputs.prefill_args())
    assert out.dtype == torch.float16
    assert rel_err(out, dense_attention(inputs)) <= 2e-3


def test_host_metadata_launch_reads_nothing_back(gen, poisoned, assert_attention_close):
    from tests.engine.host_reads import no_host_reads

    seqs = [(40, 40), (90, 7), (17, 1)]
    inputs = make_paged_inputs([c for c, _ in seqs], [n for _, n in seqs], num_q_heads=4, num_kv_heads=2,
                               head_dim=64, block_size=16, poison_unused=True, generator=gen)
    with no_host_reads() as guard:
        out = triton_prefill.prefill_attention(*inputs.prefill_args(), max_query_len=40, max_context_len=90)
    assert guard.checked > 0
    assert_attention_close(out, kernels.prefill_attention_ref(*inputs.finite().prefill_args()),
                           dense_attention(inputs), inputs.q)
