"""Beam search in the scheduler: beams share blocks, branch with copy-on-write, give blocks back when
dropped, survive preemption by recomputation beside ordinary requests, and bad combinations are refused.

The shadow engine checks every KV slot a beam reads holds that beam's own token, so a shared or copied
block with the wrong content fails the run; its top-K candidates depend on the whole context, so a beam
recomputed after preemption ranks exactly as before.
"""

from __future__ import annotations

import pytest

from services.contracts.step_protocol import TokenLogprobs
from services.request.beam_search_params import BeamSearchParams
from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.beam_search import BeamCandidates, BeamSearch
from tests.scheduler.shadow_executor import EOS
from tests.scheduler.test_scheduler import greedy, make_core, run_all


def beam(width, max_tokens, **kw):
    return SamplingParams(n=width, temperature=0, max_tokens=max_tokens, use_beam_search=True, **kw)


def _blocks_by_ref(core) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in core.pool.blocks if b.ref_cnt}


def test_beams_share_the_prompt_and_their_history(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=64, block_size=4, budget=64)
    prompt = list(range(10, 22))  # 3 full blocks
    core.add_request("b", prompt, beam(4, 12, ignore_eos=True))
    shared_seen = 0
    while core.has_unfinished():
        core.step()
        core.pool.check_invariants()
        live = [s for s in core.scheduler.running if s.request_id == "b"]
        if len(live) == 4:
            tables = [core.kv.tables[s.seq_id] for s in live]
            # The prompt's blocks are one set of physical blocks, held by every beam.
            assert all(t[:3] == tables[0][:3] for t in tables)
            assert all(b.ref_cnt == 4 for b in tables[0][:3])
            used = core.pool.num_in_use
            unshared = sum(len(t) for t in tables)
            assert used < unshared == core.kv.num_blocks_unshared()
            shared_seen += 1
    assert shared_seen > 0
    assert core.pool.num_in_use == 0
    # Copy-on-write happened: some step copied a partial block a beam branched from.
    assert any(o.blocks_to_copy for o in ex.steps)


def test_result_is_independent_of_batching_preemption_and_pool_size(tokenizer):
    """The same beam requests beside ordinary ones: in a roomy pool, and in one small enough to preempt
    them repeatedly. Same results, every block back, the pool's invariant after every step."""
    def run(num_blocks, caching):
        core, ex = make_core(tokenizer, num_blocks=num_blocks, block_size=4, budget=24, max_seqs=8, caching=caching)
        core.add_request("b0", list(range(40, 49)), beam(3, 10))
        core.add_request("g0", list(range(60, 70)), greedy(14))
        core.add_request("b1", list(range(80, 86)), beam(2, 12, length_penalty=0.5, early_stopping=True))
        core.add_request("g1", list(range(90, 99)), SamplingParams(n=2, temperature=0, max_tokens=9))
        core.add_request("b2", list(range(100, 107)), beam(4, 8, ignore_eos=True, logprobs=2))
        outs = run_all(core)
        assert core.pool.num_in_use == 0 and core.pool.num_free == core.pool.num_blocks
        return {rid: [(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in o.outputs]
                for rid, o in outs.items()}, core

    roomy, roomy_core = run(256, True)
    assert roomy_core.scheduler.num_preemptions == 0
    for caching in (True, False):
        tight, tight_core = run(26, caching)
        assert tight_core.scheduler.num_preemptions > 0
        assert tight == roomy
    assert [len(v) for k, v in sorted(roomy.items())] == [3, 2, 4, 1, 2]
    assert all(r in ("stop", "length") for v in roomy.values() for _, r, _ in v)


def test_dropped_beams_and_aborts_return_every_block(tokenizer):
    core, _ = make_core(tokenizer, num_blocks=64, block_size=4, budget=64)
    core.add_request("b", list(range(10, 19)), beam(4, 30, ignore_eos=True))
    core.add_request("g", list(range(30, 35)), greedy(30))
    for _ in range(6):
        core.step()
        core.pool.check_invariants()
        live = [s for s in core.scheduler.running if s.request_id == "b"]
        assert len(live) <= 4
        # Only the live beams hold blocks: dropped ones gave theirs back at once.
        assert set(core.kv.tables) == {s.seq_id for s in core.scheduler.running}
    out = core.abort_request("b")
    assert out.finished and len(out.outputs) == 4
    run_all(core)
    assert core.pool.num_in_use == 0


def test_beam_search_follows_transformers_ranking_rules():
    """Hand-made candidates: a finished beam outside the top W of a step is not kept, scores divide by
    the generated length including the end token, and early_stopping=True stops once W are finished."""
    def top(pairs):
        return TokenLogprobs(pairs[0][1], [t for t, _ in pairs], [lp for _, lp in pairs])

    search = BeamSearch(width=2, end_ids=frozenset({EOS}), max_new_tokens=10, length_penalty=1.0,
                        early_stopping=True)
    assert search.num_candidates == 4
    # Step 1 from the prompt: EOS ranks first, so it finishes (score -0.5 / 1).
    conts = search.step([BeamCandidates(0.0, top([(EOS, -0.5), (11, -1.0), (12, -2.0), (13, -3.0)]))], 0, [([], None)])
    assert [(c.token, c.cum_logprob) for c in conts] == [(11, -1.0), (12, -2.0)]
    assert [(h.token_ids, h.score) for h in search.finished] == [([EOS], -0.5)]
    # Step 2: an EOS ranked third of the K=4 is not kept, even with a slot free.
    conts = search.step([BeamCandidates(-1.0, top([(21, -0.25), (22, -0.5), (EOS, -2.0), (23, -4.0)])),
                         BeamCandidates(-2.0, top([(EOS, -1.0), (31, -2.0), (32, -3.0), (33, -4.0)]))],
                        1, [([11], None), ([12], None)])
    assert [(c.parent, c.token) for c in conts] == [(0, 21), (0, 22)]
    assert len(search.finished) == 1 and not search.done
    # Step 3: an EOS in the top 2 finishes with score cum / 3 tokens; 2 finished + early_stopping: done.
    conts = search.step([BeamCandidates(-1.25, top([(EOS, -0.5), (41, -1.0), (42, -2.0), (43, -3.0)])),
                         BeamCandidates(-1.5, top([(51, -1.0), (52, -2.0), (53, -3.0), (EOS, -4.0)]))],
                        2, [([11, 21], None), ([11, 22], None)])
    assert conts == [] and search.done
    assert [h.token_ids for h in search.finished] == [[EOS], [11, 21, EOS]]
    assert [h.score for h in search.finished] == pytest.approx([-0.5, -1.75 / 3])


@pytest.mark.parametrize("kw,field", [
    ({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"),
    ({"seed": 3}, "seed"), ({"min_tokens": 2}, "min_tokens"), ({"stop": ["x"]}, "stop"),
    ({"length_penalty": float("nan")}, "length_penalty"), ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {5: 1.0}}, "logit_bias"), ({"best_of": 3}, "best_of"),
])
def test_bad_combinations_are_refused_naming_the_field(kw, field):
    params = dict(n=2, temperature=0, max_tokens=4, use_beam_search=True)
    params.update(kw)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**params)
    assert err.value.field == field


def test_offline_params_and_capacity_are_validated(tokenizer):
    with pytest.raises(InvalidRequestError) as err:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert err.value.field == "beam_width"
    with pytest.raises(InvalidRequestError) as err:
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    assert err.value.field == "temperature"
    core, _ = make_core(tokenizer, num_blocks=20, block_size=4, max_seqs=4)
    with pytest.raises(InvalidRequestError) as err:
        core.add_request("wide", [10] * 4, beam(5, 4))
    assert err.value.field == "n"
    with pytest.raises(InvalidRequestError) as err:  # 4 beams x 24 tokens = 24 blocks > 20 - watermark
        core.add_request("long", [10] * 4, beam(4, 20))
    assert err.value.field == "max_tokens"
    assert not core.has_unfinished() and core.pool.num_in_use == 0
