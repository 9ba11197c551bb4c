"""The step protocol's wire form: what crosses to the engine comes back equal, through msgpack too."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from services.contracts.step_protocol import (
    ModelRunnerOutput,
    PenaltySpec,
    SamplingSpec,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprobs,
)
from services.transport.wire import WireReply, WireRequest, decode_reply, decode_request, encode_reply, encode_request

ints = st.lists(st.integers(0, 2**31 - 1), max_size=40)
specs = st.builds(SamplingSpec, st.floats(0, 2), st.floats(0.01, 1), st.integers(-1, 100),
                  st.none() | st.integers(0, 2**63 - 1), st.none() | st.integers(0, 20))
penalties = st.none() | st.builds(PenaltySpec, st.floats(-2, 2), st.floats(-2, 2), st.floats(0.01, 100),
                                   st.floats(0, 1), ints, st.lists(st.floats(-100, 100), max_size=40), ints, ints)
sequences = st.builds(ScheduledSequence, st.text(min_size=1, max_size=40), ints, st.integers(0, 8192), ints,
                      st.booleans(), specs, st.integers(1, 4), st.integers(0, 3), st.integers(0, 4096), ints,
                      st.none() | st.binary(max_size=16), penalties, st.integers(-1, 7), st.lists(ints, max_size=3))
outputs = st.builds(SchedulerOutput, st.integers(0, 2**40), st.lists(sequences, max_size=8),
                    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=4),
                    st.lists(st.tuples(st.integers(0, 7), st.text(alphabet="0123456789abcdef", min_size=64,
                                                                  max_size=64)), max_size=3))


@settings(max_examples=60, deadline=None)
@given(outputs)
def test_scheduler_output_round_trips_and_matches_asdict(out):
    wire = out.to_wire()
    expected = {**dataclasses.asdict(out), "blocks_to_copy": [list(p) for p in out.blocks_to_copy],
                "lora_slots": [list(p) for p in out.lora_slots]}
    if not out.lora_slots:
        del expected["lora_slots"]  # a step without adapters carries nothing of them
    for s in expected["sequences"]:
        if s["penalties"] is None:
            del s["penalties"]  # a row without penalties carries nothing of them
        if not s["group_block_tables"]:
            del s["group_block_tables"]  # nor a model with one KV group
    assert wire == expected
    sent = decode_request(encode_request(WireRequest(1, "step", wire)))
    assert SchedulerOutput.from_wire(sent.body) == out


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 10**5), min_size=1, max_size=3),
                       max_size=6), st.booleans(), st.lists(st.integers(0, 10**9), max_size=8))
def test_model_runner_output_round_trips(sampled, with_logprobs, expert_tokens):
    entry = TokenLogprobs(-0.25, [1, 2], [-0.25, -1.5])
    lps = {k: [entry for _ in v] for k, v in sampled.items()} if with_logprobs else {}
    drafts = {k: v[:2] for k, v in sampled.items() if len(v) > 1}  # a draft model's proposals
    out = ModelRunnerOutput(3, sampled, lps, drafts, expert_tokens)
    expected = dataclasses.asdict(out)
    if not drafts:
        del expected["draft_token_ids"]  # a step without proposals carries nothing of them
    if not expert_tokens:
        del expected["expert_tokens"]  # nor a dense model's step anything of experts
    assert out.to_wire() == expected
    back = decode_reply(encode_reply(WireReply(1, True, "i", out.to_wire())))
    assert ModelRunnerOutput.from_wire(back.body) == out
