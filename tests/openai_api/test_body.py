"""Hostile request bodies against the parser and the prompt preparation both the router and the
scheduler run: whatever hypothesis generates, the answer is a prepared request or a 4xx naming a
field, never another exception. Aimed at ranges: every integer and float field gets its boundaries."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from services.openai_api.body import parse_json_object, parse_request
from services.openai_api.errors import APIError
from services.openai_api.prompts import prepare
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from services.openai_api.responses_protocol import parse_responses_request, responses_error, to_chat
from tests.openai_api.hostile_bodies import MODEL, bodies, responses_bodies, serialise

MAX_LEN = 2048


class FakeTokenizer:
    vocab_size = 49152

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text] or []

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return [1] + [ord(c) % self.vocab_size for m in messages for c in m["content"]] + [2]

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)

@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_any_body_is_prepared_or_a_4xx_naming_a_field(case):
    chat, body = case
    raw = serialise(body)
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
    assert -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2 and 0.01 <= p.repetition_penalty <= 100
    assert 0 <= p.min_p <= 1 and p.n <= p.num_sequences <= 128
    assert all(0 <= t < FakeTokenizer.vocab_size and -100 <= b <= 100 for t, b in (p.logit_bias or {}).items())
    assert len(p.logit_bias or {}) <= 300
    assert prepared.echo is None or len(prepared.echo) == len(prepared.prompts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses_bodies())
def test_any_responses_body_is_prepared_or_a_4xx_naming_a_field(case):
    _, body = case
    try:
        req = parse_responses_request(parse_json_object(serialise(body)))
        if req.model != MODEL:
            return
        chat, where = to_chat(req)
        try:
            prepare(chat, FakeTokenizer(), MAX_LEN)
        except APIError as err:
            raise responses_error(err, where) from None
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message
        assert not (exc.param or "").startswith(("messages", "max_completion_tokens", "response_format")), exc.param


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
