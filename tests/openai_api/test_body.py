"""Hostile request bodies against the parser and the prompt preparation both the router and the
scheduler run: whatever hypothesis generates, the answer is a prepared request or a 4xx naming a
field, never another exception. Aimed at ranges: every integer and float field gets its boundaries."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.openai_api.body import parse_json_object, parse_request
from services.openai_api.errors import APIError
from services.openai_api.prompts import prepare
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "m"
MAX_LEN = 2048

BOUNDARY_INTS = [0, 1, -1, 2, 127, 128, 129, 1023, 1024, 1025, 49151, 49152, 2**31 - 1, 2**31, 2**32, 2**53,
                 2**63 - 1, 2**63, 3 * 2**62, 2**64, -(2**63), -(2**63) - 1, 10**30]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-320, 5e-324, 1e-50, 1e-6, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 1e300, -1e-9,
                   float("inf"), float("-inf"), float("nan")]
INT_FIELDS = ["max_tokens", "top_k", "n", "seed", "min_tokens", "logprobs", "top_logprobs",
              "max_completion_tokens", "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
HOSTILE_STRINGS = ["", "x", "\ud800", "a\udfffb", "\x00", "é" * 3, "😀", "<|im_end|>", "x" * 2000]

json_leaf = st.one_of(st.none(), st.booleans(), st.sampled_from(BOUNDARY_INTS), st.sampled_from(BOUNDARY_FLOATS),
                      st.sampled_from(HOSTILE_STRINGS), st.integers(), st.floats(), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)


class FakeTokenizer:
    vocab_size = 49152

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text] or []

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return [1] + [ord(c) % self.vocab_size for m in messages for c in m["content"]] + [2]


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    # Mostly well-formed skeletons, so the hostile values reach the fields behind the first checks.
    body: dict = {"model": draw(st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL),
                                          st.sampled_from(["\ud800", 5, None])))}
    if chat:
        content = draw(st.one_of(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30),
                                 st.sampled_from(HOSTILE_STRINGS), json_value))
        role = draw(st.one_of(st.just("user"), st.just("user"), st.sampled_from(["system", "tool", "wizard", 3])))
        messages = [{"role": role, "content": content}]
        body["messages"] = draw(st.one_of(st.just(messages), st.just(messages), st.just(messages),
                                          st.sampled_from([[], "hi", None])))
    else:
        body["prompt"] = draw(st.one_of(
            st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30),
            st.sampled_from(HOSTILE_STRINGS), st.lists(st.sampled_from(BOUNDARY_INTS), max_size=5),
            st.lists(st.lists(st.sampled_from(BOUNDARY_INTS), max_size=3), max_size=3),
            st.lists(st.sampled_from(HOSTILE_STRINGS), max_size=3), json_value))
    for name in draw(st.lists(st.sampled_from(INT_FIELDS), max_size=3)):
        body[name] = draw(st.one_of(st.sampled_from(BOUNDARY_INTS), json_leaf))
    for name in draw(st.lists(st.sampled_from(FLOAT_FIELDS), max_size=3)):
        body[name] = draw(st.one_of(st.sampled_from(BOUNDARY_FLOATS), json_leaf))
    if draw(st.booleans()):
        body[draw(st.sampled_from(["stop", "stop_token_ids", "stream", "stream_options", "ignore_eos", "tools",
                                   "response_format", "logit_bias", "cache_salt", "unknown_field", "echo"]))] = \
            draw(json_value)
    return chat, body


def _serialise(body: dict) -> bytes:
    # ensure_ascii keeps lone surrogates as \\ud800 escapes, exactly as a hostile client would send them.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_any_body_is_prepared_or_a_4xx_naming_a_field(case):
    chat, body = case
    raw = _serialise(body)
    try:
        parsed = parse_json_object(raw)
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, parsed)
        if req.model != MODEL:
            return  # the caller answers 404 for an unknown model; nothing below runs
        prepared = prepare(req, FakeTokenizer(), MAX_LEN)
    except APIError as exc:
        assert 400 <= exc.status < 500, exc.message
        assert exc.message
        return
    # Accepted: everything downstream relies on these holding.
    p = prepared.params
    assert 1 <= p.n <= 128 and p.temperature >= 0 and 0 < p.top_p <= 1
    assert p.seed is None or -(2**63) <= p.seed < 2**63
    assert all(0 <= t < FakeTokenizer.vocab_size for prompt in prepared.prompts for t in prompt)
    assert p.top_k <= FakeTokenizer.vocab_size and p.max_tokens + max(map(len, prepared.prompts)) <= MAX_LEN


@pytest.mark.parametrize("raw", [b"[" * 200_000, b"{\"a\":" * 100_000 + b"1" + b"}" * 100_000,
                                 b"1" * 5000, b"\xff\xfe", b"{\"prompt\": \"\xed\xa0\x80\"}", b"",
                                 b"{\"prompt\": \"\\ud800\\udc00 ok pair\", \"model\": \"m\"}"])
def test_parser_edge_cases_are_4xx_or_parsed(raw):
    try:
        out = parse_json_object(raw)
    except APIError as exc:
        assert exc.status == 400
    else:
        assert out["prompt"] == "\U00010000 ok pair"
