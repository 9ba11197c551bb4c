"""Scheduling policy: token budget, chunked prefill, decodes first, preemption, FCFS, stops, aborts."""

from __future__ import annotations

import sys

import pytest

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from tests.scheduler.shadow_executor import EOS, ShadowExecutor


def make_core(tokenizer, num_blocks=64, block_size=4, budget=32, max_seqs=8, caching=True, system="pagedserve",
              **kw):
    ex = ShadowExecutor(num_blocks, block_size, **kw)
    core = SchedulerCore(ex, tokenizer, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      enable_prefix_caching=caching, serving_system=system)
    ex.lookup = lambda seq_id: next(r.token_ids for r in core.scheduler.running if r.seq_id == seq_id)
    return core, ex


def run_all(core, limit=10_000, on_step=None):
    """Step until every request finishes (the pool's invariants checked after each step); `on_step(core)`
    runs after each step too."""
    outs = {}
    for _ in range(limit):
        if not core.has_unfinished():
            break
        for o in core.step():
            if o.finished:
                outs[o.request_id] = o
        core.pool.check_invariants()
        if on_step is not None:
            on_step(core)
    assert not core.has_unfinished()
    return outs


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_scheduler_imports_no_torch():
    assert "torch" not in sys.modules or True  # other tests may load torch; check the module graph instead
    import services.scheduler.core as ec

    src = open(ec.__file__).read() + open(ec.__file__.replace("engine_core", "scheduler")).read()
    assert "import torch" not in src


def test_chunked_prefill_splits_long_prompt_and_never_stalls_decodes(tokenizer):
    core, ex = make_core(tokenizer, budget=16)
    core.add_request("short", list(range(10, 15)), greedy(20))
    core.step()  # short's prefill
    core.add_request("long", list(range(100, 160)), greedy(2))
    while core.has_unfinished():
        core.step()
        out = ex.steps[-1]
        assert out.num_tokens <= 16
        ids = [s.seq_id for s in out.sequences]
        if "short" in ids and "long" in ids:
            assert ids.index("short") < ids.index("long"), "decode must come before the prefill chunk"
    chunks = [len(s.token_ids) for o in ex.steps for s in o.sequences if s.seq_id == "long" and len(s.token_ids) > 1]
    assert len(chunks) >= 4 and sum(chunks) == 60  # 60-token prompt split over several steps
    # Every step while "short" was decoding included it: the long prompt never stalled it.
    short_steps = [o for o in ex.steps if any(s.seq_id == "short" for s in o.sequences)]
    assert len(short_steps) == 20


def test_mixed_batches_and_max_num_seqs(tokenizer):
    core, ex = make_core(tokenizer, budget=64, max_seqs=3)
    for i in range(6):
        core.add_request(f"r{i}", [20 + i] * 6, greedy(3 + 2 * i))
    run_all(core)
    assert max(len(o.sequences) for o in ex.steps) <= 3
    assert any(any(len(s.token_ids) == 1 for s in o.sequences) and any(len(s.token_ids) > 1 for s in o.sequences)
               for o in ex.steps), "some step should mix decodes and prefills"


def test_fcfs_admission_order(tokenizer):
    core, ex = make_core(tokenizer, budget=8, max_seqs=2)
    for i in range(5):
        core.add_request(f"r{i}", [30 + i] * 4, greedy(3))
    run_all(core)
    first_seen = []
    for o in ex.steps:
        for s in o.sequences:
            if s.seq_id not in first_seen:
                first_seen.append(s.seq_id)
    assert first_seen == [f"r{i}" for i in range(5)]


def test_preemption_recomputes_and_outputs_are_unchanged(tokenizer):
    prompts = {f"r{i}": [40 + i] * 9 for i in range(6)}
    big, _ = make_core(tokenizer, num_blocks=200, caching=False)
    for rid, p in prompts.items():
        big.add_request(rid, p, greedy(24, ignore_eos=True))
    expected = {rid: o.outputs[0].token_ids for rid, o in run_all(big).items()}
    small, ex = make_core(tokenizer, num_blocks=24, caching=False)
    for rid, p in prompts.items():
        small.add_request(rid, p, greedy(24, ignore_eos=True))
    got = {rid: o.outputs[0].token_ids for rid, o in run_all(small).items()}
    assert small.scheduler.num_preemptions > 0
    assert got == expected
    assert small.pool.num_in_use == 0


def test_preempts_most_recently_admitted(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=12, caching=False, budget=64)
    for i in range(3):
        core.add_request(f"r{i}", [50 + i] * 7, greedy(12, ignore_eos=True))
    preempted = []
    orig = core.scheduler._preempt

    def spy(req):
        preempted.append((req.seq_id, [r.seq_id for r in core.scheduler.running]))
        orig(req)

    core.scheduler._preempt = spy
    run_all(core)
    assert preempted
    for victim, running in preempted:
        assert victim == running[-1]


def test_stop_conditions(tokenizer):
    core, ex = make_core(tokenizer)
    core.add_request("len", [11] * 5, greedy(7))
    ex.eos_after["eos"] = 8
    core.add_request("eos", [12] * 5, greedy(50))
    ex.eos_after["ign"] = 8
    core.add_request("ign", [12] * 5, greedy(6, ignore_eos=True))
    outs = run_all(core)
    assert outs["len"].outputs[0].finish_reason == "length" and len(outs["len"].outputs[0].token_ids) == 7
    assert outs["eos"].outputs[0].finish_reason == "stop" and outs["eos"].outputs[0].token_ids[-1] == EOS
    assert outs["ign"].outputs[0].finish_reason == "length" and len(outs["ign"].outputs[0].token_ids) == 6
    # stop token ids: learn the 3rd token of a run, then stop on it
    probe = outs["len"].outputs[0].token_ids
    core.add_request("tok", [11] * 5, greedy(7, stop_token_ids=[probe[2]]))
    o = run_all(core)["tok"].outputs[0]
    assert o.token_ids == probe[:3] and o.finish_reason == "stop" and o.stop_reason == probe[2]


def test_stop_string_truncates_text(tokenizer):
    core, ex = make_core(tokenizer)
    core.add_request("a", [11] * 5, greedy(12))
    full = run_all(core)["a"].outputs[0]
    text = tokenizer.decode(full.token_ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("degenerate text")
    core.add_request("b", [11] * 5, greedy(12, stop=[stop]))
    o = run_all(core)["b"].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[:text.index(stop)]


def test_abort_at_any_time_frees_blocks(tokenizer):
    core, ex = make_core(tokenizer, budget=8)
    core.add_request("waiting", [60] * 30, greedy(5))
    core.add_request("running", [61] * 6, greedy(50))
    core.step()
    assert core.abort_request("running").outputs[0].finish_reason == "abort"
    core.step()  # "waiting" is mid-prefill now
    core.abort_request("waiting")
    core.add_request("queued", [62] * 6, greedy(5))
    core.abort_request("queued")
    assert not core.has_unfinished()
    assert core.pool.num_in_use == 0
    core.pool.check_invariants()


def test_prefix_hit_skips_cached_blocks(tokenizer):
    core, ex = make_core(tokenizer, block_size=4, budget=256)
    shared = list(range(100, 140))  # 10 full blocks
    core.add_request("a", shared + [7, 8], greedy(3))
    run_all(core)
    core.add_request("b", shared + [9], greedy(3))
    outs = run_all(core)
    first = next(s for o in ex.steps for s in o.sequences if s.seq_id == "b")
    assert first.start_pos == 40 and len(first.token_ids) == 1
    assert outs["b"].num_cached_tokens == 40
    assert core.kv.prefix_hits >= 40


def test_parallel_sampling_forks_with_copy_on_write(tokenizer):
    core, ex = make_core(tokenizer, block_size=4)
    core.add_request("n3", [70] * 6, SamplingParams(temperature=1.0, n=3, max_tokens=6, seed=1))
    outs = run_all(core)
    o = outs["n3"]
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in o.outputs)
    assert len({tuple(c.token_ids) for c in o.outputs}) == 3
    assert any(out.blocks_to_copy for out in ex.steps), "the shared partial block must be copied on write"
    prefill = [s for out in ex.steps for s in out.sequences if s.seq_id == "n3" and len(s.token_ids) > 1]
    assert len(prefill) == 1, "the prompt is computed once for all samples"


def test_bad_input_rejected_without_disturbing_in_flight(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=32)
    core.add_request("ok", [80] * 5, greedy(10))
    core.step()
    bad = [
        ([], greedy(3), "prompt"),
        ([1, 2, 10**6], greedy(3), "prompt"),
        ([5] * 5000, greedy(3), "prompt"),
        ([5] * 200, greedy(3), "prompt"),  # more than the KV pool holds
    ]
    for prompt, params, field in bad:
        with pytest.raises(InvalidRequestError) as e:
            core.add_request("bad", prompt, params)
        assert e.value.field == field
    with pytest.raises(InvalidRequestError, match="already in flight"):
        core.add_request("ok", [1, 2], greedy(3))
    outs = run_all(core)
    assert list(outs) == ["ok"] and len(outs["ok"].outputs[0].token_ids) == 10


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"temperature": -0.1}, "temperature"), ({"n": 0}, "n"),
    ({"top_k": -2}, "top_k"), ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_request_waits_for_a_prefix_being_computed_instead_of_recomputing_it(tokenizer):
    core, ex = make_core(tokenizer, block_size=4, budget=256)
    shared = list(range(100, 140))  # 10 full blocks
    core.add_request("first", shared + [7, 8], greedy(3))
    core.add_request("second", shared + [9, 10, 11], greedy(3))  # same prefix, arrives in the same step
    core.add_request("other", list(range(500, 520)), greedy(3))  # unrelated: not held back
    outs = run_all(core)
    first_step = {s.seq_id for s in ex.steps[0].sequences}
    assert first_step == {"first", "other"}, "second waits while first computes the shared blocks"
    assert outs["second"].num_cached_tokens == 40
    second = next(s for o in ex.steps for s in o.sequences if s.seq_id == "second")
    assert second.start_pos == 40 and len(second.token_ids) == 3
    assert outs["second"].outputs[0].token_ids == run_alone(tokenizer, shared + [9, 10, 11], 3)


def run_alone(tokenizer, prompt, n):
    core, _ = make_core(tokenizer, block_size=4, budget=256, caching=False)
    core.add_request("x", prompt, greedy(n))
    return run_all(core)["x"].outputs[0].token_ids
