"""Generated request bodies aimed at ranges, for the parser tests and the HTTP fuzzing of the
reliability suite: valid skeletons with hostile values in them (boundaries of every integer and float
field, NaN and infinities, lone surrogates, wrong types, deep structures, unknown fields)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

MODEL = "m"

BOUNDARY_INTS = [0, 1, -1, 2, 127, 128, 129, 1023, 1024, 1025, 49151, 49152, 2**31 - 1, 2**31, 2**32, 2**53,
                 2**63 - 1, 2**63, 3 * 2**62, 2**64, -(2**63), -(2**63) - 1, 10**30]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-320, 5e-324, 1e-50, 1e-6, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 1e300, -1e-9,
                   float("inf"), float("-inf"), float("nan")]
INT_FIELDS = ["max_tokens", "top_k", "n", "seed", "min_tokens", "logprobs", "top_logprobs",
              "max_completion_tokens", "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"]
HOSTILE_STRINGS = ["", "x", "\ud800", "a\udfffb", "\x00", "é" * 3, "😀", "<|im_end|>", "x" * 2000]

json_leaf = st.one_of(st.none(), st.booleans(), st.sampled_from(BOUNDARY_INTS), st.sampled_from(BOUNDARY_FLOATS),
                      st.sampled_from(HOSTILE_STRINGS), st.integers(), st.floats(), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)


@st.composite
def bodies(draw, model: str = MODEL):
    chat = draw(st.booleans())
    # Mostly well-formed skeletons, so the hostile values reach the fields behind the first checks.
    body: dict = {"model": draw(st.one_of(st.just(model), st.just(model), st.just(model),
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
                                   "response_format", "logit_bias", "cache_salt", "unknown_field", "echo",
                                   "use_beam_search", "early_stopping"]))] = \
            draw(json_value)
    return chat, body


def serialise(body: dict) -> bytes:
    # ensure_ascii keeps lone surrogates as \\ud800 escapes, exactly as a hostile client would send them.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


