"""The hybrid KV cache: sliding-window groups hold only what their window sees, blocks that slide out go
back to the pool at once, admission counts it, prefix hits are reused only where every group holds what
the continuation needs, and the pool's accounting holds per group. Through the real scheduler and a
model-free engine that checks every position each group's layers attend to (tests/scheduler/shadow_executor.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.request.sampling_params import SamplingParams
from services.scheduler.block_pool import BlockPool
from services.scheduler.core import SchedulerCore
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.sequence import Sequence
from tests.scheduler.shadow_executor import ShadowExecutor
from tests.scheduler.test_scheduler import greedy, run_all


def make_core(tokenizer, windows, num_blocks=400, block_size=4, budget=32, max_seqs=8):
    ex = ShadowExecutor(num_blocks, block_size, kv_group_windows=windows)
    core = SchedulerCore(ex, tokenizer, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    ex.lookup = lambda seq_id: next(r.token_ids for r in core.scheduler.running if r.seq_id == seq_id)
    return core, ex


def held_per_group(core) -> dict[int, int]:
    return {g: c["in_use"] for g, c in core.pool.counts()["groups"].items()}


def test_a_long_request_holds_its_windows_not_its_history(tokenizer):
    """The memory figure: one 4,096-token request (4,080 prompt + 16 generated), blocks of 16, window 512,
    from the pool's own counts after every step: a full-attention model holds all 256 blocks per group,
    the sliding-window one 33 (its window plus the block being written)."""
    peaks = {}
    for name, windows in (("full", [0]), ("window 512", [512]), ("gemma3-like 1 full : 5 sliding", [0] + [512] * 5)):
        core, _ = make_core(tokenizer, windows, num_blocks=3000, block_size=16, budget=512)
        core.add_request("long", [10 + i % 900 for i in range(4080)], greedy(16, ignore_eos=True))
        peak_after_step = {}
        while core.has_unfinished():
            core.step()
            core.pool.check_invariants()
            for g, n in held_per_group(core).items():
                peak_after_step[g] = max(peak_after_step.get(g, 0), n)
            if core.scheduler.running:
                last = held_per_group(core)
        peaks[name] = (last, peak_after_step)
        assert core.pool.num_in_use == 0
    full_last, _ = peaks["full"]
    sliding_last, sliding_peak = peaks["window 512"]
    assert full_last == {0: 256}
    assert sliding_last == {0: 33}  # ceil(511 / 16) + the block written next: never more after a step
    assert max(sliding_peak.values()) <= 33 + 512 // 16  # a chunk of 512 in flight at most
    hybrid_last, _ = peaks["gemma3-like 1 full : 5 sliding"]
    assert hybrid_last == {0: 256, 1: 33, 2: 33, 3: 33, 4: 33, 5: 33}
    print(f"KV blocks held at the end of a 4,096-token request (block 16): {peaks}")


def test_admission_counts_windows(tokenizer):
    """A prompt longer than the pool holds is admitted on a sliding-window model (its window fits), and
    refused by name where every block would be needed at once."""
    core, _ = make_core(tokenizer, [16], num_blocks=20, block_size=4, budget=8)
    core.add_request("long", list(range(10, 210)), greedy(5, ignore_eos=True))  # 200 tokens = 50 blocks
    outs = run_all(core)
    assert len(outs["long"].outputs[0].token_ids) == 5
    core, _ = make_core(tokenizer, [0, 16], num_blocks=20, block_size=4, budget=8)
    try:
        core.add_request("long", list(range(10, 210)), greedy(5))
        raise AssertionError("a full-attention group needs every block")
    except Exception as e:
        assert "KV blocks" in str(e), e


def _sequence(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(temperature=0, max_tokens=4), 0)


def _compute(kv: KVCacheManager, req: Sequence, n: int) -> None:
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.commit(req)


def test_prefix_hit_needs_every_group(tokenizer):
    """A hit of P tokens is reused only where the full group holds blocks 0..P and each sliding group the
    blocks its window needs before P; blocks a window no longer needs are not asked of the cache."""
    bs, window = 4, 6
    pool = BlockPool(64)
    kv = KVCacheManager(pool, bs, hash_seed=1, group_windows=[None, window])
    tokens = list(range(100, 133))  # 33 tokens: 8 full blocks
    a = _sequence("a", tokens)
    _compute(kv, a, 33)
    kv.free(a)
    pool.check_invariants()
    b = _sequence("b", tokens + [7])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 8  # every full block; the window before position 32 is blocks 6..7
    assert all(col[0] is not None for col in hit)
    assert [col[1] is not None for col in hit] == [False] * 6 + [True] * 2
    # Released blocks stay cached: evict the sliding group's block 6, which a continuation from 32 (blocks
    # 6..7) and from 28 (blocks 5..6) both need, so the hit shrinks to 24 (blocks 4..5).
    victim = hit[6][1]
    pool.free_queue.remove(victim)
    pool.free_queue.appendleft(victim)
    pool.allocate(1)  # takes the evicted block
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 6, len(hit)
    assert [col[1] is not None for col in hit] == [False] * 4 + [True] * 2
    assert kv.allocate_slots(b, 34 - 24, cached=hit)
    pool.check_invariants()


@settings(max_examples=25, deadline=None)
@given(windows=st.lists(st.sampled_from([0, 3, 5, 8, 13]), min_size=1, max_size=3),
       lengths=st.lists(st.integers(1, 60), min_size=1, max_size=6), shared=st.integers(0, 24),
       num_blocks=st.integers(24, 80), budget=st.sampled_from([8, 16, 64]))
def test_random_workloads_give_what_full_attention_gives(tokenizer, windows, lengths, shared, num_blocks, budget):
    """Any mix of windows, shared prefixes, pool sizes and chunk budgets: every request finishes with the
    tokens a full-attention pool gives, every position each group attends to holds its own token, the
    pool's per-group accounting holds after every step, and every block comes back."""
    prefix = list(range(500, 500 + shared))
    prompts = [prefix + [10 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate(lengths)]
    results = []
    for groups in (windows, [0]):
        # The same blocks per group: with several full-attention groups a request holds one table in each,
        # and a pool sized for one group can fail one the full-attention pool finishes (found by hypothesis).
        core, _ = make_core(tokenizer, groups, num_blocks=max(num_blocks, 40) * len(groups), budget=budget,
                            max_seqs=4)
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, greedy(6, ignore_eos=True))
        outs = run_all(core)
        assert core.pool.num_in_use == 0
        results.append({k: o.outputs[0].token_ids for k, o in outs.items()})
    assert results[0] == results[1]
