"""Property-based tests of the block pool under random admit / grow / finish / fork / prefix-hit / evict.

Driven through the real engine core with the model-free ShadowExecutor, which also checks that every
position a sequence reads holds its own token. After every step: free + cached + in use == total, no
block is written by a sequence that does not hold it alone. When everything ends: every block is free
or cached and all reference counts are zero.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.request.sampling_params import SamplingParams
from services.scheduler.block_pool import BlockPool
from services.scheduler.core import SchedulerCore
from tests.scheduler.shadow_executor import ShadowExecutor

PREFIXES = [list(range(200, 216)), list(range(300, 308)), []]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        from tests.scheduler.conftest import shared_tokenizer

        self.ex = ShadowExecutor(num_blocks=40, block_size=4)
        self.core = SchedulerCore(self.ex, shared_tokenizer(), max_num_seqs=6, max_num_batched_tokens=24)
        core = self.core
        self.ex.lookup = lambda sid: next(r.token_ids for r in core.scheduler.running if r.seq_id == sid)
        self.ex.on_execute = self._check_single_writer
        self.next_id = 0

    def _check_single_writer(self, out) -> None:
        bs = self.ex.info.block_size
        pool = self.core.pool
        copied_to = {dst for _, dst in out.blocks_to_copy}
        for s in out.sequences:
            for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
                block = pool.blocks[s.block_table[p // bs]]
                assert block.ref_cnt == 1, f"{s.seq_id} writes block {block.block_id} shared by {block.ref_cnt}"
                assert block.block_hash is None, "a cached (immutable) block must never be written"
                assert block.block_id not in copied_to or p // bs < len(s.block_table)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(10, 900), min_size=1, max_size=14),
          n=st.integers(1, 3), max_tokens=st.integers(1, 12), temperature=st.sampled_from([0.0, 1.0]))
    def admit(self, prefix, suffix, n, max_tokens, temperature):
        self.core.add_request(f"r{self.next_id}", prefix + suffix,
                              SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=self.next_id,
                                             ignore_eos=True))
        self.next_id += 1

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            if self.core.has_unfinished():
                self.core.step()

    @rule(which=st.integers(0, 50))
    def abort(self, which):
        if self.core.groups:
            rid = sorted(self.core.groups)[which % len(self.core.groups)]
            self.core.abort_request(rid)

    @invariant()
    def accounting(self):
        pool: BlockPool = self.core.pool
        pool.check_invariants()
        refs = {}
        for table in self.core.kv.tables.values():
            for b in table:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id}: ref {b.ref_cnt} != holders"

    def teardown(self):
        for _ in range(5000):
            if not self.core.has_unfinished():
                break
            self.core.step()
        assert not self.core.has_unfinished()
        pool = self.core.pool
        pool.check_invariants()
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.num_free == pool.num_blocks  # every block is free or cached
        assert not self.core.kv.tables


TestBlockPoolProperties = PoolMachine.TestCase
TestBlockPoolProperties.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_free_queue_is_lru_and_o1():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 111, 0)
    pool.register(b, 222, 1)
    pool.free(b)  # b freed first -> evicted first
    pool.free(a)
    pool.check_invariants()
    assert pool.lookup(111) is a and pool.lookup(222) is b
    got = [pool.allocate() for _ in range(3)]
    assert b in got and a not in got and pool.lookup(222) is None and pool.lookup(111) is a
    pool.touch(a)  # prefix hit on a cached free block pulls it out of the free queue
    assert a.ref_cnt == 1 and pool.num_free == 0
    pool.check_invariants()
