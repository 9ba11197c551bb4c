"""The AVX512-BF16 paged decode kernel (kernels/cpu/decode_bf16.cpp) against float64 attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu import decode_attention_cpu, load
from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err

# Around the kernel's seams: odd contexts (a token without a partner), its 8-row windows and
# 16-token score groups, block edges.
SEAM_LENS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 300, 1100]


@pytest.fixture(scope="module")
def ext():
    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)")
    if not mod.decode_bf16_usable(3, 64, 3):
        pytest.skip("this CPU has no AVX512-BF16")
    amx_before = mod.set_amx_enabled(False)  # on an AMX machine the tile kernel would take these shapes
    yield mod
    mod.set_amx_enabled(amx_before)


def _check(lens, group, head_dim, block_size, kv_heads=3, shared_blocks=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    inp = make_paged_inputs(lens, num_q_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim,
                            block_size=block_size, dtype=torch.bfloat16, shared_blocks=shared_blocks,
                            poison_unused=True, generator=gen)
    out = decode_attention_cpu(*inp.decode_args())
    assert not out.isnan().any()  # never reads a slot past a context, not even an odd one's partner
    assert rel_err(out, dense_attention(inp)) <= 1e-2


@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 64), (3, 64), (4, 64), (1, 128), (2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_whole_sequence_tasks_match_float64(ext, group, head_dim, block_size):
    # Enough sequences that each task is a whole sequence (every KV head).
    assert ext.decode_bf16_usable(group, head_dim, 3)
    _check(SEAM_LENS * 2, group, head_dim, block_size, shared_blocks=1)


@pytest.mark.parametrize("lens", [[1], [1100], [5, 700]])
def test_few_sequences_split_by_head_match_float64(ext, lens):
    _check(lens, 3, 64, 16)


def test_unequal_contexts_go_longest_first_without_mixing_outputs(ext):
    # Tasks run out of order; each output must still land in its own sequence's row.
    _check([2000, 1, 900, 3, 1500, 17] * 4, 3, 64, 16, seed=3)


def test_query_views_of_a_fused_buffer(ext):
    gen = torch.Generator().manual_seed(1)
    inp = make_paged_inputs([40, 41, 300] * 4, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                            dtype=torch.bfloat16, generator=gen)
    wide = torch.randn(12, 9, 128, generator=gen).bfloat16()
    wide[:, :, :64] = inp.q
    out = decode_attention_cpu(wide[:, :, :64], *inp.decode_args()[1:])
    assert rel_err(out, dense_attention(inp)) <= 1e-2


def test_other_shapes_fall_to_the_generic_kernel(ext):
    assert not ext.decode_bf16_usable(8, 64, 2)  # 8 x 2 query registers and 32 accumulators: too many
    assert not ext.decode_bf16_usable(3, 80, 3)
    _check([5, 40, 300], 8, 64, 16, kv_heads=2)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=20), group=st.sampled_from([1, 2, 3, 4]),
       block_size=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_generated_batches_match_float64(ext, lens, group, block_size, seed):
    _check(lens, group, 64, block_size, kv_heads=2, seed=seed)
