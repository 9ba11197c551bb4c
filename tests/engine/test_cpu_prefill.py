"""CPU prefill attention (fresh prompts on their new keys, batched continuations over the cache) against
float64 dense attention, with a mix of fresh prompts, chunk continuations and single-token chunks."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err
from services.engine.cpu_prefill import prefill_attention_cpu


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_fresh_and_continuing_prefills(block_size):
    lens, q_lens = [40, 17, 100, 33, block_size + 1], [40, 5, 64, 1, block_size + 1]
    inp = make_paged_inputs(lens, q_lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size)
    starts = inp.query_start_loc.tolist()
    spans = [(starts[i], starts[i + 1], lens[i]) for i in range(len(lens))]
    # The new tokens' keys and values, as the engine would pass them (already written to the cache).
    k = torch.empty(starts[-1], 3, 64)
    v = torch.empty(starts[-1], 3, 64)
    for i, (s, e, ctx) in enumerate(spans):
        for j in range(e - s):
            p = ctx - (e - s) + j
            block = inp.block_tables[i, p // block_size].item()
            k[s + j], v[s + j] = inp.k_cache[block, p % block_size], inp.v_cache[block, p % block_size]
    dense = dense_attention(inp)
    out = prefill_attention_cpu(inp.q, k, v, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale)
    assert rel_err(out, dense) <= 1e-5
    step_cache: dict = {}
    for _ in range(2):  # the second call (the next layer) reuses the step's masks and block indices
        out = prefill_attention_cpu(inp.q, k, v, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale,
                                    step_cache)
        assert rel_err(out, dense) <= 1e-5
    assert step_cache.pop("route") == "mixed"  # fresh prompts in the step
    assert len(step_cache) == 3  # the three continuing sequences


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_bfloat16_continuations_through_the_kernels(block_size, amx):
    """Short chunks go through the decode kernel; long ones, where the fresh-prompt kernel runs (AVX512-BF16
    without AMX), over their gathered context through it."""
    from kernels.cpu import load

    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile")
    if amx and not mod.amx_available():
        pytest.skip("this CPU or kernel offers no AMX tiles")
    lens, q_lens = [40, 17, 100, 33, block_size + 1, 500], [40, 5, 64, 1, block_size + 1, 64]
    inp = make_paged_inputs(lens, q_lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size,
                            dtype=torch.bfloat16, poison_unused=True)
    starts = inp.query_start_loc.tolist()
    spans = [(starts[i], starts[i + 1], lens[i]) for i in range(len(lens))]
    slots = [inp.block_tables[i, p // block_size].item() * block_size + p % block_size
             for i, (s, e, ctx) in enumerate(spans) for p in range(ctx - (e - s), ctx)]
    k = inp.k_cache.view(-1, 3, 64)[slots]
    v = inp.v_cache.view(-1, 3, 64)[slots]
    previous = mod.set_amx_enabled(amx)  # off: the AVX-512 kernel, as on a CPU without AMX
    try:
        step_cache: dict = {}
        out = prefill_attention_cpu(inp.q, k, v, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale,
                                    step_cache)
    finally:
        mod.set_amx_enabled(previous)
    assert "decodes" in step_cache  # the short continuations went through the decode kernel
    from services.engine.cpu_prefill import _gather_kernel

    gathered = {key for key in step_cache if isinstance(key, int)}  # contexts gathered out of the cache
    assert gathered == ({2, 5} if _gather_kernel(inp.q) is not None else set())  # the 64-token chunks
    assert not out.isnan().any()
    assert rel_err(out, dense_attention(inp)) <= 1e-2


@pytest.mark.parametrize("amx", [True, False])
def test_a_step_of_short_continuations_is_one_decode_call(amx):
    """A speculative verify step (every sequence continues its cache by a few tokens) takes the decode route
    once per step and gives bit for bit what the per-layer gather-and-scatter route gives."""
    from kernels.cpu import load

    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile")
    if amx and not mod.amx_available():
        pytest.skip("this CPU or kernel offers no AMX tiles")
    lens, q_lens = [40, 300, 17, 129], [5, 9, 1, 3]
    inp = make_paged_inputs(lens, q_lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                            dtype=torch.bfloat16, poison_unused=True)
    starts = inp.query_start_loc.tolist()
    spans = [(starts[i], starts[i + 1], lens[i]) for i in range(len(lens))]
    k = torch.zeros(starts[-1], 3, 64, dtype=torch.bfloat16)  # unused by the continuation routes
    # q as the model passes it: a strided view of a wider projection
    wide = torch.randn(starts[-1], 9 * 64 + 64, dtype=torch.bfloat16)
    wide[:, :9 * 64] = inp.q.reshape(starts[-1], -1)
    q = wide[:, :9 * 64].view(starts[-1], 9, 64)
    previous = mod.set_amx_enabled(amx)
    try:
        step_cache: dict = {}
        fast = [prefill_attention_cpu(q, k, k, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale,
                                      step_cache) for _ in range(2)]
        slow = prefill_attention_cpu(q, k, k, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale)
    finally:
        mod.set_amx_enabled(previous)
    assert step_cache["route"] == "decodes"
    assert torch.equal(fast[0], slow) and torch.equal(fast[1], slow)
    assert rel_err(fast[0], dense_attention(inp)) <= 1e-2
    # a fresh prompt in the step: the mixed route
    mixed: dict = {}
    prefill_attention_cpu(q, k, k, inp.k_cache, inp.v_cache, inp.block_tables, [(0, 5, 5)] + spans[1:],
                          inp.scale, mixed)
    assert mixed["route"] == "mixed"


def test_bfloat16_fresh_prompts_take_the_kernel_their_length_calls_for():
    """In bfloat16, fresh prompts up to AMX_PREFILL_MAX_TOKENS go through the AMX prefill kernel where AMX is
    in use (the AVX512-BF16 one without it), longer ones through SDPA there; every route matches float64."""
    from kernels.cpu import amx_in_use, load
    from services.engine import cpu_prefill

    mod = load()
    if mod is None:
        pytest.fail("the CPU kernels did not compile")
    limit = cpu_prefill.AMX_PREFILL_MAX_TOKENS
    lens = [40, limit, limit + 1]
    inp = make_paged_inputs(lens, lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                            dtype=torch.bfloat16)
    q = inp.q
    if amx_in_use():
        assert cpu_prefill._fresh_kernel(q, 40) is mod.amx_prefill
        assert cpu_prefill._fresh_kernel(q, limit) is mod.amx_prefill
        assert cpu_prefill._fresh_kernel(q, limit + 1) is None  # SDPA
        assert cpu_prefill._gather_kernel(q) is None  # continuations keep the AMX decode kernel
    elif mod.prefill_bf16_supported(64):
        assert cpu_prefill._fresh_kernel(q, limit + 1) is mod.prefill_bf16
    starts = inp.query_start_loc.tolist()
    spans = [(starts[i], starts[i + 1], lens[i]) for i in range(len(lens))]
    slots = [inp.block_tables[i, p // 16].item() * 16 + p % 16 for i, n in enumerate(lens) for p in range(n)]
    k, v = inp.k_cache.view(-1, 3, 64)[slots], inp.v_cache.view(-1, 3, 64)[slots]
    out = prefill_attention_cpu(q, k, v, inp.k_cache, inp.v_cache, inp.block_tables, spans, inp.scale)
    assert not out.isnan().any()
    assert rel_err(out, dense_attention(inp)) <= 1e-2
