"""Speculative decoding in the scheduler: n-gram drafts ride in the step's token budget, the shadow engine
verifies them, and every output, every prefix-cache hash and every KV block is what it would be without
speculation (preemption, prefix hits, n > 1, stops, aborts and max_tokens included)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.contracts.speculative_config import SpeculativeConfig, SpeculativeConfigError
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.spec_decode.ngram import TokenBuffer, propose_ngram
from services.scheduler.spec_decode.policy import AcceptanceRate, Candidate, StepCostModel, plan_drafts
from tests.scheduler.shadow_executor import EOS, ShadowExecutor
from tests.scheduler.test_scheduler import run_all as _run_all

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "knee_tokens": 64}


def make_core(tokenizer, spec=NGRAM, num_blocks=96, block_size=4, budget=64, max_seqs=8, caching=True):
    ex = ShadowExecutor(num_blocks, block_size, copying=True)
    core = SchedulerCore(ex, tokenizer, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                         enable_prefix_caching=caching, speculative_config=spec)
    ex.lookup = lambda seq_id: next(r.token_ids for r in core.scheduler.running if r.seq_id == seq_id)
    return core, ex


def run_all(core, limit=20_000, on_step=None):
    return _run_all(core, limit, on_step)  # drafts make more steps than the plain tests' bound


def workload(seed=0, n=10):
    rng = random.Random(seed)
    reqs = []
    shared = [rng.randrange(10, 200) for _ in range(12)]
    for i in range(n):
        motif = [rng.randrange(10, 60) for _ in range(rng.randrange(3, 8))]
        prompt = (shared if i % 3 == 0 else []) + motif * rng.randrange(2, 5) + [rng.randrange(10, 900)]
        params = dict(temperature=0, max_tokens=rng.randrange(8, 40))
        if i % 4 == 1:
            params["n"] = 2
        if i % 5 == 2:
            params["stop_token_ids"] = [motif[1]]
        if i % 7 == 3:
            params["min_tokens"] = 6
        reqs.append((f"r{i}", prompt, SamplingParams(**params)))
    return reqs


def outputs(core, reqs, abort=()):
    for rid, prompt, params in reqs:
        core.add_request(rid, prompt, params)
    aborted = {}

    def maybe_abort(c):
        for rid in list(abort):
            if rid in c.groups and c.generation_tokens > 30:
                c.abort_request(rid)
                aborted[rid] = True

    outs = run_all(core, on_step=maybe_abort)
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items() if rid not in aborted}


@pytest.mark.parametrize("num_blocks", [96, 24])  # 24: preemption and recomputation under speculation
def test_outputs_identical_with_and_without_ngram(tokenizer, num_blocks):
    plain, _ = make_core(tokenizer, spec=None, num_blocks=num_blocks)
    spec, ex = make_core(tokenizer, num_blocks=num_blocks)
    want = outputs(plain, workload())
    got = outputs(spec, workload())
    assert got == want
    assert ex.drafts_kept > 20, "drafts should often be accepted on a copying workload"
    stats = spec.stats().spec_decode
    assert stats.num_accepted_tokens == ex.drafts_kept and stats.num_draft_tokens == ex.drafts_seen
    assert spec.pool.num_free == spec.pool.num_blocks and not spec.kv.tables  # every block back
    if num_blocks == 24:
        assert spec.scheduler.num_preemptions > 0


def test_every_block_back_after_aborts_and_preemption(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=24)
    outputs(core, workload(seed=3, n=12), abort=("r2", "r5", "r9"))
    assert core.pool.num_free == core.pool.num_blocks and not core.kv.tables
    assert core.scheduler.num_preemptions > 0 and ex.drafts_seen > 0


def test_drafts_ride_in_the_token_budget_and_respect_max_tokens(tokenizer):
    core, ex = make_core(tokenizer, budget=10)
    reqs = workload(seed=5, n=6)
    got = outputs(core, reqs)
    assert all(o.num_tokens <= 10 for o in ex.steps)
    for rid, _, params in reqs:
        if rid in got:
            assert all(len(t) <= params.max_tokens for t in got[rid])
    drafted = [s for o in ex.steps for s in o.sequences if s.num_draft_tokens]
    assert drafted and all(s.num_draft_tokens <= 4 and s.sample and s.num_samples == 1 for s in drafted)


def test_prefix_hashes_cover_committed_tokens_only(tokenizer):
    """A second request with the first one's whole output as its prompt hits the blocks speculation
    committed, and computes the same continuation."""
    core, ex = make_core(tokenizer)
    prompt = [11, 12, 13, 14, 15] * 4 + [16]
    first = outputs(core, [("a", prompt, SamplingParams(temperature=0, max_tokens=30))])["a"][0]
    core2 = outputs(core, [("b", prompt + first[:20], SamplingParams(temperature=0, max_tokens=10))])["b"][0]
    assert core.kv.prefix_hits >= 36  # (20 + 20 - 1) // 4 * 4 tokens of "b" were cached
    plain, _ = make_core(tokenizer, spec=None)
    assert outputs(plain, [("b", prompt + first[:20], SamplingParams(temperature=0, max_tokens=10))])["b"][0] == core2


def test_no_drafts_when_the_step_is_compute_bound(tokenizer):
    spec = dict(NGRAM, knee_tokens=2)
    core, ex = make_core(tokenizer, spec=spec, max_seqs=8)
    reqs = [(f"r{i}", [21, 22, 23, 20 + i] * 4 + [21], SamplingParams(temperature=0, max_tokens=20)) for i in range(8)]
    outputs(core, reqs)
    busy = [o for o in ex.steps if len(o.sequences) >= 6]
    assert busy and all(not s.num_draft_tokens for o in busy for s in o.sequences)
    # Alone (one decode at a knee of 2: threshold 1/3), a sequence drafts.
    core, ex = make_core(tokenizer, spec=spec)
    outputs(core, reqs[:1])
    assert any(s.num_draft_tokens for o in ex.steps for s in o.sequences)


def test_disable_by_batch_size(tokenizer):
    core, ex = make_core(tokenizer, spec=dict(NGRAM, disable_by_batch_size=2))
    reqs = [(f"r{i}", [21, 22, 23, 20 + i] * 4 + [21], SamplingParams(temperature=0, max_tokens=20)) for i in range(4)]
    outputs(core, reqs)
    for o in ex.steps:
        if len(o.sequences) > 2:
            assert not any(s.num_draft_tokens for s in o.sequences)


def test_ngram_proposal_is_longest_then_earliest_match():
    def tokens(ids):
        return TokenBuffer().sync(ids)

    toks = [1, 2, 3, 4, 2, 3, 9, 1, 2, 3]
    # [1, 2, 3] occurs at 0 (longest, length 3 with max 3): what followed it there is proposed.
    assert propose_ngram(tokens(toks), 1, 3, 4) == [4, 2, 3, 9]
    # With max 2: [2, 3] first occurs at 1.
    assert propose_ngram(tokens(toks), 2, 2, 2) == [4, 2]
    assert propose_ngram(tokens(toks + [77]), 1, 3, 4) == []  # 77 never occurred before
    assert propose_ngram(tokens([5]), 1, 3, 4) == []
    buf = TokenBuffer()
    grown = list(range(300))
    buf.sync(grown[:10])
    assert list(buf.sync(grown)) == grown  # appended
    assert list(buf.sync(grown[:5])) == grown[:5]  # a shorter list (a reset sequence) starts over


def _ngram_by_definition(toks: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Every earlier end position, its match length with the context's end (capped at max_n), the longest
    then earliest: the rule as written, slowly."""
    total = len(toks)
    if total <= min_n or k <= 0:
        return []
    best, best_end = 0, -1
    for end in range(total - 1):
        n = 0
        while n < max_n and end - n >= 0 and toks[end - n] == toks[total - 1 - n]:
            n += 1
        if n > best:
            best, best_end = n, end
    return toks[best_end + 1:best_end + 1 + k] if best >= min_n else []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=60) | st.lists(st.integers(0, 70000), max_size=40),
       st.integers(1, 4), st.integers(0, 4), st.integers(0, 6))
def test_ngram_proposal_equals_its_definition(toks, min_n, extra, k):
    """Small alphabets make long repeated matches; large ids have bytes that match across token boundaries
    (the search must skip those)."""
    max_n = min_n + extra
    assert propose_ngram(TokenBuffer().sync(toks), min_n, max_n, k) == _ngram_by_definition(toks, min_n, max_n, k)


def test_plan_follows_the_marginal_rule():
    # One decode, knee 31: threshold 1/32; acceptance 0.5 gives drafts while 0.5**i beats useful/(knee+T).
    got = plan_drafts([Candidate("a", 8, 0.5)], step_tokens=1, budget=100, knee=31)
    assert got == {"a": 4}  # 0.5**4 = 1/16 > (1 + 0.94) / 36; 0.5**5 = 1/32 < (1 + 0.97) / 37
    # At ten times the knee, a draft must be likelier than ~0.9.
    assert plan_drafts([Candidate("a", 8, 0.8)], step_tokens=320, budget=100, knee=32) == {}
    # 0.95 > 320 / 352 = 0.909 but 0.95**2 = 0.9025 < 320.95 / 353 = 0.909
    assert plan_drafts([Candidate("a", 8, 0.95)], step_tokens=320, budget=100, knee=32) == {"a": 1}
    assert plan_drafts([Candidate("a", 8, 0.9)], step_tokens=1, budget=2, knee=32) == {"a": 2}  # the budget


def test_later_drafts_follow_their_own_rate():
    """Acceptance after an accepted draft (a copy under way) is its own rate: long drafts survive a poor first
    position, and a sequence whose later drafts fail keeps short ones."""
    rate = AcceptanceRate()
    rate.observe(4, 2)  # first kept, second kept, third refused
    rate.observe(4, 0)  # first refused
    rate.observe(0, 0)  # no drafts: nothing learned
    assert (rate.first_accepted, rate.first_trials, rate.accepted, rate.trials) == (1, 2, 1, 2)
    assert rate.rate(0.5) == pytest.approx((1 + 2) / (2 + 4))
    assert rate.then_rate(0.5) == pytest.approx((1 + 2) / (2 + 4))
    # p_i = 0.5 * 0.9**(i - 1): the eighth is 0.24, above (1 + 3.1) / (31 + 8) = 0.105
    assert plan_drafts([Candidate("a", 8, 0.5, 0.9)], step_tokens=1, budget=100, knee=31) == {"a": 8}
    # a later rate of 0.3: 0.5 * 0.3 = 0.15 > 1.5 / 33; 0.045 < 1.65 / 34
    assert plan_drafts([Candidate("a", 8, 0.5, 0.3)], step_tokens=1, budget=100, knee=31) == {"a": 2}


def test_the_replica_prior_falls_with_rejections_to_its_floor():
    """After a run of rejected first drafts (a drafter that never agrees), a new sequence starts from the
    floor: it still drafts in a step of one decode, and not in a compute-bound step of 64."""
    from services.scheduler.spec_decode.speculator import Speculator

    sp = Speculator(SpeculativeConfig.parse(json.dumps(NGRAM)), frozenset(), 1000)
    assert sp.prior() == 0.5

    class Row:
        drafting = None

    for _ in range(300):
        sp.verified(Row(), 4, 0)
    assert sp.replica_first_rate < 0.01 and sp.prior() == 0.1
    first = AcceptanceRate().rate(sp.prior())
    assert plan_drafts([Candidate("a", 4, first, 0.5)], step_tokens=1, budget=100, knee=64) == {"a": 3}
    assert plan_drafts([Candidate(i, 4, first, 0.5) for i in range(64)], step_tokens=64, budget=1000,
                       knee=330) == {}
    for _ in range(300):
        sp.verified(Row(), 4, 2)  # accepted again: the prior follows
    assert sp.prior() > 0.9


def test_step_cost_model_reads_the_knee():
    m = StepCostModel()
    assert m.knee == 32.0  # the default until it has seen steps of different sizes
    for t in [1, 2, 5, 40, 3, 100, 7, 1, 60, 4, 9]:
        m.observe(t, 0.010 + 0.0005 * t)  # a = 10 ms, b = 0.5 ms: knee 20
    assert m.knee == pytest.approx(20, rel=0.01)
    m.observe(3, 5.0)  # a step stalled by something else is clipped to twice the fit, not believed
    assert 15 < m.knee < 25
    for t in [1, 2, 5, 40, 3, 100, 7, 1, 60, 4, 9] * 3:  # and forgotten as steps go by
        m.observe(t, 0.010 + 0.0005 * t)
    assert m.knee == pytest.approx(20, rel=0.05)


@pytest.mark.parametrize("bad,key", [
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "x"}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ("{not json", "<json>"),
])
def test_config_refuses_by_name(bad, key):
    with pytest.raises(SpeculativeConfigError) as exc:
        SpeculativeConfig.parse(bad)
    assert exc.value.key == key


def test_config_defaults_as_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse(c.to_json()) == c
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


def test_eos_ends_a_speculated_sequence(tokenizer):
    core, ex = make_core(tokenizer)
    ex.eos_after["e"] = 30
    got = outputs(core, [("e", [20, 21, 22, 23] * 5, SamplingParams(temperature=0, max_tokens=50))])
    assert got["e"][0][-1] == EOS and len(got["e"][0]) == 30 - 20
