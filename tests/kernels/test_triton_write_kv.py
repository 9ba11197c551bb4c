"""Triton KV-cache writes (interpreter) against the reference: the same slots written, nothing else."""

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import triton_write_kv  # noqa: E402
from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err  # noqa: E402


def random_write(gen, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """New keys/values for distinct random slots, about a quarter of them padding (-1)."""
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (32, 3, 128), (16, 1, 80)])
def test_write_kv_matches_reference(gen, block_size, num_kv_heads, head_dim, dtype, slot_dtype):
    k, v, k_cache, v_cache, slots = random_write(gen, 37, 6, block_size, num_kv_heads, head_dim, dtype)
    slots = slots.to(slot_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    before = k_cache.clone()
    kernels.write_kv_ref(k, v, k_ref, v_ref, slots)
    triton_write_kv.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots[slots >= 0].long()
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[written], k[slots >= 0])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched], before.view(-1, num_kv_heads, head_dim)[untouched])


def test_write_kv_strided_inputs(gen):
    # k and v as views into one fused projection output [tokens, 2 * heads, dim].
    k, v, k_cache, v_cache, slots = random_write(gen, 20, 4, 16, 2, 64, torch.float32)
    kv = torch.cat([k, v], dim=1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.write_kv_ref(k, v, k_ref, v_ref, slots)
    kernels.write_kv(kv[:, :2], kv[:, 2:], k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_written_tokens_are_attended(gen, poisoned):
    # End to end: write a prompt's keys and values through write_kv, then prefill over them.
    inputs = make_paged_inputs([50], [50], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               generator=gen)
    want = dense_attention(inputs)
    pos = torch.arange(50)
    slots = inputs.block_tables[0].long()[pos // 16] * 16 + pos % 16
    k = inputs.k_cache.view(-1, 2, 64)[slots].clone()
    v = inputs.v_cache.view(-1, 2, 64)[slots].clone()
    inputs.k_cache.fill_(float("nan"))
    inputs.v_cache.fill_(float("nan"))
    kernels.write_kv(k, v, inputs.k_cache, inputs.v_cache, slots.to(torch.int32))
    assert rel_err(kernels.prefill_attention(*inputs.prefill_args()), want) <= 1e-5


def test_write_kv_no_tokens():
    cache = torch.zeros(2, 16, 2, 64)
    empty = torch.zeros(0, 2, 64)
    kernels.write_kv(empty, empty, cache, cache.clone(), torch.zeros(0, dtype=torch.int32))
    assert not cache.any()


def test_checked_slots_launch_reads_nothing_back(gen):
    from tests.engine.host_reads import no_host_reads

    k, v, k_cache, v_cache, slots = random_write(gen, 20, 4, 16, 2, 64, torch.float32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.write_kv_ref(k, v, k_ref, v_ref, slots)
    with no_host_reads():
        kernels.write_kv(k, v, k_cache, v_cache, slots, slots_checked=True)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with no_host_reads(), pytest.raises(AssertionError, match="host read"):
        kernels.write_kv(k, v, k_cache, v_cache, slots)  # unchecked slots are read back and checked
