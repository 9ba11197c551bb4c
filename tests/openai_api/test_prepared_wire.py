"""The router's prepared request on the internal hop: every request the HTTP layer prepares arrives at the
replica as exactly that prepared request, and whatever a hop delivers (a router of another version, a bug,
a forged body) is re-checked with every boundary's rules: a prepared request or a 4xx, never a 500."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.openai_api.body import parse_json_object, parse_request
from services.openai_api.errors import APIError
from services.openai_api.prepared_wire import from_wire, to_wire
from services.openai_api.prompts import prepare
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from services.openai_api.tool_prompt import CALL_CLOSE
from tests.openai_api.hostile_bodies import MODEL, bodies, serialise
from tests.openai_api.test_body import MAX_LEN, FakeTokenizer

VOCAB = FakeTokenizer.vocab_size


def _prepared(chat: bool, body: dict):
    try:
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, parse_json_object(serialise(body)))
        if req.model != MODEL:
            return None
        return prepare(req, FakeTokenizer(), MAX_LEN)
    except APIError:
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_what_the_router_prepares_is_what_the_replica_serves(case):
    chat, body = case
    prepared = _prepared(chat, body)
    if prepared is None:
        return
    got = from_wire(json.loads(to_wire(prepared)), VOCAB, MAX_LEN, prepared.kind)
    assert got.prompts == prepared.prompts and got.model == prepared.model and got.echo == prepared.echo
    assert (got.stream, got.include_usage, got.tools) == (prepared.stream, prepared.include_usage, prepared.tools)
    assert got.params == prepared.params  # every field, the constraint (tool grammar included) too
    assert got.params.stop_strings == prepared.params.stop_strings  # the tool-call stop after the client's


def test_a_tool_request_keeps_its_derived_stop_beyond_the_clients_limit():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [f"s{i}" for i in range(16)],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "parallel_tool_calls": False, "tool_choice": "required"}
    prepared = _prepared(True, body)
    assert prepared is not None and prepared.params.stop_strings[-1] == CALL_CLOSE
    got = from_wire(json.loads(to_wire(prepared)), VOCAB, MAX_LEN, "chat")
    assert got.params.stop_strings == prepared.params.stop_strings and len(got.params.stop_strings) == 17


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies(), st.lists(st.tuples(st.sampled_from(["", "params", "tools", "params.structured_outputs"]),
                                    st.text(max_size=12), _json), min_size=1, max_size=3))
def test_any_delivered_body_is_served_as_prepared_or_refused_with_a_4xx(case, mutations):
    chat, body = case
    prepared = _prepared(chat, body)
    if prepared is None:
        return
    wire = json.loads(to_wire(prepared))
    keys = {"": list(wire), "params": list(wire["params"]), "tools": list(wire["tools"] or {}),
            "params.structured_outputs": list(wire["params"]["structured_outputs"] or {})}
    for where, name, value in mutations:
        target = wire
        for part in filter(None, where.split(".")):
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            continue
        # Mostly a known field with a hostile value, sometimes an unknown one.
        key = keys[where][hash(name) % len(keys[where])] if keys[where] and len(name) % 3 else name
        target[key] = value
    try:
        got = from_wire(wire, VOCAB, MAX_LEN, prepared.kind)
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message
        return
    # Served: it holds what every boundary holds a request to.
    assert all(0 <= t < VOCAB for p in got.prompts for t in p)
    assert got.params.max_tokens is None or got.params.max_tokens + max(map(len, got.prompts)) <= MAX_LEN
