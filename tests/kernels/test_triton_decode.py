"""Triton decode attention (interpreter, float32) against the PyTorch reference and float64 dense math."""

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import triton_decode  # noqa: E402
from kernels.paged_inputs import PagedInputs, dense_attention, make_paged_inputs, rel_err  # noqa: E402

TOL = 1e-5


def run_decode(inputs: PagedInputs, **knobs):
    """(Triton output, reference output on the NaN-free cache, float64 dense attention)."""
    out = triton_decode.decode_attention(*inputs.decode_args(), **knobs)
    return out, kernels.decode_attention_ref(*inputs.finite().decode_args()), dense_attention(inputs)


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_edge_lengths(gen, poisoned, head_dim, block_size, gqa, assert_attention_close):
    rnd = random.Random(gen.initial_seed())
    lens = [1, block_size - 1, block_size, block_size + 1, rnd.randint(2, 4 * block_size)]
    inputs = make_paged_inputs(lens, num_q_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim,
                               block_size=block_size, shared_blocks=1, poison_unused=True, generator=gen)
    assert_attention_close(*run_decode(inputs), inputs.q)
    # Contexts shorter than one split's share leave empty splits for the reduce to skip.
    assert_attention_close(*run_decode(inputs, num_splits=3), inputs.q)


@pytest.mark.parametrize("tile_n", [16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_long_context_splits(gen, poisoned, num_splits, tile_n, assert_attention_close):
    rnd = random.Random(gen.initial_seed())
    lens = [rnd.randint(1001, 1300), rnd.randint(1, 40)]
    inputs = make_paged_inputs(lens, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=32,
                               shared_blocks=2, poison_unused=True, generator=gen)
    assert_attention_close(*run_decode(inputs, num_splits=num_splits, tile_n=tile_n), inputs.q)


def test_decode_odd_head_dim_and_strided_query(gen, poisoned, assert_attention_close):
    inputs = make_paged_inputs([5, 40, 17], num_q_heads=9, num_kv_heads=3, head_dim=80, block_size=16,
                               poison_unused=True, generator=gen)
    # q as a view into a fused qkv projection: rows are further apart than num_q_heads * head_dim.
    qkv = torch.randn(3, 15, 80, generator=gen)
    qkv[:, :9] = inputs.q
    assert_attention_close(*run_decode(dataclasses.replace(inputs, q=qkv[:, :9])), inputs.q)


def test_decode_public_entry_point(gen, poisoned):
    inputs = make_paged_inputs([33, 7], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               generator=gen)
    out = kernels.decode_attention(*inputs.decode_args())
    assert rel_err(out, dense_attention(inputs)) <= TOL


def test_decode_empty_batch():
    inputs = make_paged_inputs([], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    assert kernels.decode_attention(*inputs.decode_args()).shape == (0, 4, 64)
    assert kernels.decode_attention_ref(*inputs.decode_args()).shape == (0, 4, 64)


def test_choose_num_splits_fills_the_device():
    # A small batch with a long context is split; a full batch is not; short contexts never are.
    assert triton_decode.choose_num_splits(1, 8, 32768, sms=132) >= 32
    assert triton_decode.choose_num_splits(64, 8, 4096, sms=132) == 1
    assert triton_decode.choose_num_splits(1, 8, 100, sms=132) == 1


def test_decode_float16(gen, poisoned):
    # The interpreter runs float16 dots (not bfloat16 ones): this covers casting probabilities to V's dtype.
    inputs = make_paged_inputs([1, 31, 300], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                               dtype=torch.float16, generator=gen)
    out = triton_decode.decode_attention(*inputs.decode_args(), num_splits=2)
    assert out.dtype == torch.float16
    assert rel_err(out, dense_attention(inputs)) <= 2e-3


def test_host_metadata_launch_reads_nothing_back(gen, poisoned, assert_attention_close):
    # With the longest context given on the host, the launch makes no device-to-host read, and each
    # sequence splits its own context: one long and several short ones, 4 forced splits.
    from tests.engine.host_reads import no_host_reads

    inputs = make_paged_inputs([1100, 3, 16, 300], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               poison_unused=True, generator=gen)
    with no_host_reads() as guard:
        out = triton_decode.decode_attention(*inputs.decode_args(), max_context_len=1100, num_splits=4,
                                             min_split_tokens=16)
    assert guard.checked > 0
    assert_attention_close(out, kernels.decode_attention_ref(*inputs.finite().decode_args()),
                           dense_attention(inputs), inputs.q)
    with pytest.raises(ValueError, match="block table too short"):
        triton_decode.decode_attention(*inputs.decode_args(), max_context_len=10_000)


def test_useful_splits_matches_the_kernels_division():
    # The host's count of splits the longest context fills, for the grid.
    assert triton_decode.useful_splits(1100, 4, 256, 64) == 4  # 275 -> 320 a split
    assert triton_decode.useful_splits(300, 8, 256, 64) == 2  # 256 a split at least
    assert triton_decode.useful_splits(1, 64, 256, 64) == 1
