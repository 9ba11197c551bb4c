"""Guided decoding in the scheduler core: a matcher per sequence, advanced only on committed tokens.

The shadow engine picks each constrained token among those the step's mask allows (as a function of
the context, so recomputation reproduces it). Whatever the batch does to a sequence (chunked prefill,
preemption and recomputation, prefix hits, n > 1 forks, a failing step re-run by isolation), every
output must satisfy its constraint and end with "stop", because its matcher saw exactly its committed
tokens once.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.request.structured_outputs import StructuredOutputsParams
from tests.scheduler.test_scheduler import make_core, run_all

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                   "inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                    "maximum": 999}},
                             "required": ["n"], "additionalProperties": False}},
    "required": ["ok", "size", "tags", "inner"],
    "additionalProperties": False,
}


def guided(max_tokens=200, n=1, **so) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, structured_outputs=StructuredOutputsParams(**so))


def check(out, so: dict, n: int = 1) -> None:
    assert out.error is None, out.error
    assert len(out.outputs) == n
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        if "json" in so:
            jsonschema.validate(json.loads(c.text), so["json"])
        elif "regex" in so:
            assert re.fullmatch(so["regex"], c.text), c.text
        elif "choice" in so:
            assert c.text in so["choice"]


CASES = [{"json": SCHEMA}, {"regex": r"[a-c]{2,5}-\d{1,3}"}, {"choice": ["alpha", "beta", "gamma delta"]}]


def test_every_constraint_holds_in_one_mixed_batch(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=256, budget=64, vocab_size=tokenizer.vocab_size)
    for i, so in enumerate(CASES * 3):
        core.add_request(f"r{i}", [100 + i] * (5 + i), guided(**so))
    core.add_request("plain", [7] * 9, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs = run_all(core)
    for i, so in enumerate(CASES * 3):
        check(outs[f"r{i}"], so)
    assert len(outs["plain"].outputs[0].token_ids) == 12
    masked = [s for o in ex.steps for s in o.sequences if s.token_bitmask is not None]
    assert masked and all(s.sample and len(s.token_bitmask) == 4 * ((tokenizer.vocab_size + 31) // 32)
                          for s in masked)
    assert not any(s.token_bitmask for o in ex.steps for s in o.sequences if s.seq_id == "plain")
    stats = core.stats().guided
    assert stats.constrained_rows > 0 and stats.sampled_rows > stats.constrained_rows and stats.mask_steps > 0


def test_preemption_chunked_prefill_and_prefix_hits_keep_the_grammar(tokenizer):
    # A pool this small preempts; a budget this small chunks every prompt; shared prompts hit the cache.
    core, ex = make_core(tokenizer, num_blocks=40, block_size=4, budget=16, vocab_size=tokenizer.vocab_size)
    shared = list(range(300, 340))
    for i in range(6):
        core.add_request(f"g{i}", shared + [i + 1], guided(max_tokens=120, json=SCHEMA))
    outs = run_all(core)
    for i in range(6):
        check(outs[f"g{i}"], {"json": SCHEMA})
    assert core.scheduler.num_preemptions > 0, "the test must preempt"
    assert any(len(s.token_ids) == 16 for o in ex.steps for s in o.sequences), "and chunk prefills"
    assert max(o.num_cached_tokens for o in outs.values()) > 0, "and hit the prefix cache"
    alone, _ = make_core(tokenizer, num_blocks=256, budget=256, caching=False, vocab_size=tokenizer.vocab_size)
    alone.add_request("g0", shared + [1], guided(max_tokens=120, json=SCHEMA))
    assert run_all(alone)["g0"].outputs[0].text == outs["g0"].outputs[0].text


def test_n3_forks_clone_the_matcher(tokenizer):
    core, _ = make_core(tokenizer, num_blocks=128, vocab_size=tokenizer.vocab_size)
    so = {"regex": r"(yes|no|maybe)( [0-9]{1,2})?"}
    core.add_request("n3", [5] * 7, SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=20,
                                                   structured_outputs=StructuredOutputsParams(**so)))
    out = run_all(core)["n3"]
    check(out, so, n=3)


def test_a_failing_step_rerun_by_isolation_never_double_advances(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=256, budget=64, vocab_size=tokenizer.vocab_size)

    def poison(out):  # from step 6 on (mid-JSON), any step holding "bad" fails; isolation re-runs the others
        if out.step_id >= 6 and any(s.seq_id == "bad" for s in out.sequences):
            raise RuntimeError("injected step failure")

    ex.on_execute = poison
    core.add_request("bad", [9] * 5, guided(json=SCHEMA))
    for i in range(3):
        core.add_request(f"ok{i}", [20 + i] * 6, guided(json=SCHEMA))
    outs = run_all(core)
    assert len(outs["bad"].outputs[0].token_ids) >= 4
    assert outs["bad"].error and "injected" in outs["bad"].error
    for i in range(3):
        check(outs[f"ok{i}"], {"json": SCHEMA})


def test_grammar_end_finishes_with_stop_and_unsatisfiable_fails_with_a_reason(tokenizer):
    core, ex = make_core(tokenizer, num_blocks=128, vocab_size=tokenizer.vocab_size)
    core.add_request("choice", [4] * 5, guided(choice=["done"]))
    # min_tokens bans EOS, and a complete choice allows nothing else: the grammar's end wins.
    core.add_request("min", [4] * 6, SamplingParams(temperature=0, max_tokens=50, min_tokens=10,
                                                    structured_outputs=StructuredOutputsParams(choice=["x"])))
    outs = run_all(core)
    assert outs["choice"].outputs[0].text == "done" and outs["choice"].outputs[0].finish_reason == "stop"
    assert outs["min"].outputs[0].text == "x" and outs["min"].outputs[0].finish_reason == "stop"
    core.add_request("lied", [4] * 5, guided(regex="abc"))
    ex.on_execute = lambda out: [setattr(s, "token_bitmask", b"\xff" * len(s.token_bitmask))
                                 for s in out.sequences if s.token_bitmask]  # an engine ignoring the mask
    out = run_all(core)["lied"]
    assert out.error and "structured output" in out.error
    assert core.pool.num_free == core.pool.num_blocks, "every block comes back"


def test_bad_constraints_are_refused_before_queueing(tokenizer):
    core, _ = make_core(tokenizer, vocab_size=tokenizer.vocab_size)
    with pytest.raises(InvalidRequestError, match="unknown name") as e:
        core.add_request("x", [1, 2, 3], guided(grammar="start: nowhere"))
    assert e.value.field == "structured_outputs.grammar"
    with pytest.raises(InvalidRequestError, match="grammar limits") as e:
        core.add_request("y", [1, 2, 3], guided(regex="((a{100}){100}){100}"))
    assert e.value.field == "structured_outputs.regex" and not core.groups and not core.has_unfinished()
