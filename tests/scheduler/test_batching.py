"""Request-level batching admits a new batch only when the last one has finished; iteration-level admits
whenever a sequence leaves."""

from __future__ import annotations

from services.scheduler.batching import Batching
from tests.scheduler.test_scheduler import greedy, make_core, run_all


def test_admits_only_between_batches():
    assert Batching.REQUEST.admits(0) and not Batching.REQUEST.admits(1)
    assert Batching.ITERATION.admits(0) and Batching.ITERATION.admits(5)


def _admission_steps(tokenizer, system):
    core, ex = make_core(tokenizer, num_blocks=256, block_size=4, budget=64, max_seqs=3, system=system,
                         max_model_len=64)
    for i in range(7):
        core.add_request(f"r{i}", [40 + i] * 4, greedy(2 + 5 * (i % 3), ignore_eos=True))
    run_all(core)
    assert core.pool.num_in_use == 0
    seen, admitted = set(), []
    for step, out in enumerate(ex.steps):
        new = {s.seq_id for s in out.sequences} - seen
        seen |= new
        admitted.append((step, new, {s.seq_id for s in out.sequences}))
    return admitted


def test_request_level_batches_run_until_their_last_member_finishes(tokenizer):
    steps = _admission_steps(tokenizer, "request-level")
    batches = [(step, new) for step, new, _ in steps if new]
    assert [len(b) for _, b in batches] == [3, 3, 1]
    for (step, _), (prev_step, prev_batch) in zip(batches[1:], batches, strict=False):
        ran_before = steps[step - 1][2]
        assert not ran_before - prev_batch, "only the previous batch ran before a new one"
        assert step > prev_step
    # Within a batch, a member that finished early is not replaced.
    for _, new, ran in steps:
        assert not new or len(ran) == len(new)


def test_iteration_level_refills_the_batch_as_soon_as_a_member_leaves(tokenizer):
    steps = _admission_steps(tokenizer, "orca-max")
    assert any(new and len(ran) > len(new) for _, new, ran in steps), "a request joined a running batch"
