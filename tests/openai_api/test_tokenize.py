"""vLLM's /tokenize and /detokenize bodies with the real SmolLM2 tokenizer: what vLLM answers (ids equal
to the tokenizer's own, token strings, the chat template applied), and every hostile body hypothesis
generates is an answer or a 4xx naming a field, never another exception."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings

from services.openai_api.body import parse_json_object
from services.openai_api.errors import APIError
from services.openai_api.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize
from tests.openai_api.hostile_bodies import serialise, tokenize_bodies


def test_tokenize_and_detokenize_round_trip(smol_tokenizer, hf_smol_tokenizer):
    text = "The keeper of the lighthouse ✓"
    got = asyncio.run(tokenize(parse_tokenize({"prompt": text, "return_token_strs": True}), smol_tokenizer, 256))
    assert got["tokens"] == hf_smol_tokenizer(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 256
    assert got["token_strs"] == hf_smol_tokenizer.convert_ids_to_tokens(got["tokens"])
    assert detokenize(parse_detokenize({"tokens": got["tokens"]}), smol_tokenizer) == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = asyncio.run(tokenize(parse_tokenize({"messages": messages}), smol_tokenizer, 256))
    assert chat["tokens"] == smol_tokenizer.apply_chat_template(messages)  # itself checked against transformers
    assert chat["token_strs"] is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokenize_bodies())
def test_any_tokenize_body_is_answered_or_a_4xx(smol_tokenizer, case):
    path, body = case
    try:
        parsed = parse_json_object(serialise(body))
        if path == "/tokenize":
            out = asyncio.run(tokenize(parse_tokenize(parsed), smol_tokenizer, 256))
            assert out["count"] == len(out["tokens"])
        else:
            assert isinstance(detokenize(parse_detokenize(parsed), smol_tokenizer)["prompt"], str)
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message
