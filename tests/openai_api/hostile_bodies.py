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
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                "length_penalty"]
# Ranges of the sampling fields, with their edges (min_p, penalties, logit_bias values).
EDGE_FLOATS = [-100.0, -100.0001, 100.0, 100.5, -2.0, -2.0001, 2.0001, 0.01, 0.0099, 100.0001, 1e-9]
# logit_bias keys: token ids as decimal strings, and everything that is not one.
BIAS_KEYS = ["0", "5", "05", "-1", "49151", "49152", "2147483648", "abc", "", " 5", "\u0663", "1e3", "\ud800",
             "9" * 12, "9" * 13]
HOSTILE_STRINGS = ["", "x", "\ud800", "a\udfffb", "\x00", "é" * 3, "😀", "<|im_end|>", "x" * 2000]

json_leaf = st.one_of(st.none(), st.booleans(), st.sampled_from(BOUNDARY_INTS), st.sampled_from(BOUNDARY_FLOATS),
                      st.sampled_from(HOSTILE_STRINGS), st.integers(), st.floats(), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)

# Structured output: regexes built to blow up or not to parse, schemas generated at random (with the
# same leaves in the wrong places), grammars that do not compile or are over the size limit.
HOSTILE_REGEXES = ["(a{100}){100}{100}", "((a{100}){100}){100}", "a{1000000}", "(x{1,1000}){1,1000}", "(a+)+$",
                   "((a|b)*)*c", "[", "(?<=x)y", r"\p{NoSuchClass}", "a{2,1}", "", "[0-9]{3}"]
HOSTILE_GRAMMARS = ["start: nowhere", "start: start", "root ::= [a-", "",
                    'start: %json {"type": 5}', 'start: "x" %json {"type": "object"}', "%llguidance {}\nstart: /(a+)+/"]
# Past the size limit (built lazily: a strategy's repr would otherwise hold the text).
oversized = st.sampled_from([200_000, 50_000]).map(lambda n: "x" * n if n > 100_000 else 'start: "a"' + ' | "b"' * n)
schema_leaf = st.one_of(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                     {"type": "null"}, {"type": "string", "format": "no-such-format"}, {"type": "nonsense"},
                     {"type": "integer", "minimum": 5, "maximum": 1}, {"enum": []}, {"$ref": "#/$defs/missing"},
                     {"type": "string", "minLength": 10**9}, {"type": "array", "minItems": 10**6}, True, False]),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(HOSTILE_REGEXES)),
    st.builds(lambda v: {"enum": v}, st.lists(json_leaf, min_size=1, max_size=3)),
    st.builds(lambda v: {"const": v}, json_leaf), json_leaf)
json_schemas = st.recursive(schema_leaf, lambda inner: st.one_of(
    st.builds(lambda props, req, extra: {"type": "object", "properties": props, "required": req,
                                         "additionalProperties": extra},
              st.dictionaries(st.text(max_size=6), inner, max_size=4), st.lists(st.text(max_size=6), max_size=3),
              st.one_of(st.booleans(), inner)),
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner,
              st.sampled_from([0, 1, 3, -1, 10**9])),
    st.builds(lambda xs, k: {k: xs}, st.lists(inner, max_size=3), st.sampled_from(["anyOf", "oneOf", "allOf"]))),
    max_leaves=10)
constraint_values = {
    "guided_regex": st.one_of(st.sampled_from(HOSTILE_REGEXES), oversized, json_leaf),
    "guided_grammar": st.one_of(st.sampled_from(HOSTILE_GRAMMARS), oversized, json_leaf),
    "guided_choice": st.one_of(st.lists(st.sampled_from(HOSTILE_STRINGS), max_size=3), json_value),
    "guided_json": st.one_of(json_schemas, json_value),
    "structured_outputs": st.one_of(
        st.builds(lambda k, v: {k: v}, st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
                  st.one_of(json_schemas, st.sampled_from(HOSTILE_REGEXES + HOSTILE_GRAMMARS), json_value)),
        json_value),
    "response_format": st.one_of(
        st.builds(lambda s, strict: {"type": "json_schema", "json_schema": {"name": "x", "schema": s,
                                                                             "strict": strict}},
                  json_schemas, st.one_of(st.booleans(), json_leaf)),
        st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]), json_value),
}


logit_biases = st.one_of(
    st.dictionaries(st.sampled_from(BIAS_KEYS),
                    st.one_of(st.sampled_from(EDGE_FLOATS), st.sampled_from(BOUNDARY_FLOATS), json_leaf), max_size=5),
    st.integers(290, 310).map(lambda n: {str(i): 1.0 for i in range(n)}), json_value)


@st.composite
def tokenize_bodies(draw, model: str = MODEL) -> tuple[str, dict]:
    """(path, body) for vLLM's /tokenize (prompt or messages) and /detokenize."""
    path = draw(st.sampled_from(["/tokenize", "/detokenize"]))
    body: dict = {}
    if draw(st.booleans()):
        body["model"] = draw(st.one_of(st.just(model), st.sampled_from(["other", "\ud800", 5])))
    if path == "/detokenize":
        body["tokens"] = draw(st.one_of(st.lists(st.sampled_from(BOUNDARY_INTS), max_size=6), json_value))
    elif draw(st.booleans()):
        body["prompt"] = draw(st.one_of(st.text(max_size=30), st.sampled_from(HOSTILE_STRINGS), json_value))
        for name in draw(st.lists(st.sampled_from(["add_special_tokens", "return_token_strs"]), max_size=2)):
            body[name] = draw(st.one_of(st.booleans(), json_leaf))
    else:
        content = draw(st.one_of(st.text(min_size=1, max_size=30), st.sampled_from(HOSTILE_STRINGS), json_value))
        body["messages"] = draw(st.one_of(st.just([{"role": "user", "content": content}]), json_value))
        for name in draw(st.lists(st.sampled_from(["add_generation_prompt", "return_token_strs", "extra"]),
                                  max_size=2)):
            body[name] = draw(st.one_of(st.booleans(), json_leaf))
    return path, body


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
        if draw(st.integers(0, 3)) == 0:
            messages += draw(tool_history)
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
        body[name] = draw(st.one_of(st.sampled_from(BOUNDARY_FLOATS), st.sampled_from(EDGE_FLOATS), json_leaf))
    if draw(st.integers(0, 5)) == 0:
        body["logit_bias"] = draw(logit_biases)
    if not chat and draw(st.integers(0, 5)) == 0:
        body["echo"] = draw(st.one_of(st.booleans(), json_leaf))
    if chat and draw(st.integers(0, 2)) == 0:
        body.update(draw(tool_fields))
    if draw(st.booleans()):
        body[draw(st.sampled_from(["stop", "stop_token_ids", "stream", "stream_options", "ignore_eos", "tools",
                                   "response_format", "logit_bias", "cache_salt", "unknown_field", "echo",
                                   "use_beam_search", "early_stopping"]))] = \
            draw(json_value)
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(sorted(constraint_values)))
        body[name] = draw(constraint_values[name])
        body.setdefault("max_tokens", 8)  # a valid constraint is served: keep the fuzzing campaign short
    return chat, body


# Tools: valid ones among hostile ones (bad names, parameter schemas that are no object or no schema, a
# tool_choice naming what is missing), and histories whose tool messages answer calls or do not.
_PARAMS = st.one_of(st.just({"type": "object", "properties": {"x": {"type": "integer"}}}), st.just({}),
                    st.sampled_from([{"type": "string"}, {"type": "object", "properties": 5}, {"$ref": "#/nope"},
                                     {"type": "object", "required": ["x"], "properties": {"x": {"pattern": "(a+)+$"}}},
                                     {"type": "object", "properties": {"x": {"minItems": 2**63}}}]), json_value)
_NAMES = st.one_of(st.sampled_from(["f", "get_weather", "g-2"]), st.sampled_from(HOSTILE_STRINGS), json_leaf)
tool_def = st.one_of(
    st.builds(lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}}, _NAMES, _PARAMS),
    st.builds(lambda n: {"type": "function", "function": {"name": n}}, _NAMES), json_value)
tool_fields = st.fixed_dictionaries({}, optional={
    "tools": st.one_of(st.lists(tool_def, max_size=3), json_value),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]), json_value,
                             st.builds(lambda n: {"type": "function", "function": {"name": n}}, _NAMES)),
    "parallel_tool_calls": st.one_of(st.booleans(), json_leaf)})
_CALL = st.builds(lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
                  st.sampled_from(["call_1", "call_2", ""]), _NAMES, st.one_of(st.just('{"x": 1}'), json_leaf))
tool_history = st.lists(st.one_of(
    st.builds(lambda calls: {"role": "assistant", "content": None, "tool_calls": calls}, st.lists(_CALL, max_size=2)),
    st.builds(lambda i, c: {"role": "tool", "tool_call_id": i, "content": c},
              st.one_of(st.sampled_from(["call_1", "call_2", "call_9"]), json_leaf), st.text(max_size=10))),
    max_size=3)


@st.composite
def responses_bodies(draw, model: str = MODEL):
    """Bodies for /v1/responses: a string or items (messages, function calls and their outputs) as input."""
    item = st.one_of(
        st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "assistant", "system", "tool"]),
                  st.one_of(st.text(max_size=20), json_value)),
        st.builds(lambda i, n, a: {"type": "function_call", "call_id": i, "name": n, "arguments": a},
                  st.sampled_from(["c1", "c2"]), _NAMES, st.one_of(st.just("{}"), json_leaf)),
        st.builds(lambda i, o: {"type": "function_call_output", "call_id": i, "output": o},
                  st.sampled_from(["c1", "c3"]), st.one_of(st.text(max_size=10), json_leaf)), json_value)
    body: dict = {"model": draw(st.one_of(st.just(model), st.just(model), json_leaf)),
                  "input": draw(st.one_of(st.text(min_size=1, max_size=30), st.lists(item, max_size=4), json_leaf))}
    extra = draw(st.fixed_dictionaries({}, optional={
        "instructions": st.one_of(st.text(max_size=20), json_leaf),
        "max_output_tokens": st.one_of(st.sampled_from(BOUNDARY_INTS), json_leaf),
        "temperature": st.one_of(st.sampled_from(BOUNDARY_FLOATS), json_leaf),
        "top_p": st.sampled_from(BOUNDARY_FLOATS),
        "tools": st.one_of(st.lists(st.builds(lambda n, p: {"type": "function", "name": n, "parameters": p},
                                              _NAMES, _PARAMS), max_size=2), json_value),
        "tool_choice": st.one_of(st.sampled_from(["auto", "required", "none"]), json_value),
        "text": st.one_of(st.just({"format": {"type": "text"}}), json_value),
        "stream": st.booleans(),
        "previous_response_id": st.text(max_size=5), "store": json_leaf, "unknown_field": json_value}))
    body.update(extra)
    return "responses", body


def serialise(body: dict) -> bytes:
    # ensure_ascii keeps lone surrogates as \\ud800 escapes, exactly as a hostile client would send them.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


