"""Structured output through `pagedserve serve` (router + replica in one process, tiny random Llama) with
the official openai client: response_format json_schema (strict, pydantic through `parse`) and
json_object, vLLM's structured_outputs and guided_* fields, streaming and not, n > 1; every output
parses and validates with finish_reason "stop", streamed text equals the whole answer, bad constraints
are a 400 naming the field, and the structured-output metrics are exported. The model's weights are
random, so whatever structure the answers have comes from the grammar."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from services.contracts import metric_names as M
from tests.e2e.openai_checks import client, model_id
from tests.e2e.test_serve import served

pytest.importorskip("services.scheduler.async_scheduler")


class Pet(BaseModel):
    kind: Literal["cat", "dog", "newt"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: Annotated[str, Field(max_length=10)]
    pets: list[Pet] = Field(max_length=2)
    verified: bool


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["city", "rank", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON."}]


@pytest.fixture(scope="module")
def serve_url(tiny_llama_dir):
    with served(tiny_llama_dir) as url:
        yield url


def test_json_schema_and_pydantic_parse(serve_url):
    c = client(serve_url)
    model = model_id(c)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    whole = c.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, temperature=0,
                                      max_tokens=120)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, temperature=0,
                                            max_tokens=120, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    several = c.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, temperature=1.0,
                                        seed=4, n=3, max_tokens=120)
    for choice in several.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    parsed = c.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person, max_tokens=150,
                                      temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"
    obj = c.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                    max_tokens=200, temperature=0)
    if obj.choices[0].finish_reason == "stop":  # free keys and strings: a random model may run out of tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_fields_on_completions_streamed_and_not(serve_url):
    c = client(serve_url)
    model = model_id(c)
    cases = [({"guided_regex": r"[A-Z]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
             ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
             ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ({"structured_outputs": {"grammar": 'start: "go " DIR\nDIR: "left" | "right"'}},
              lambda t: t in ("go left", "go right"))]
    for extra, ok in cases:
        whole = c.completions.create(model=model, prompt="Answer:", max_tokens=80, temperature=0, extra_body=extra)
        text = whole.choices[0].text
        assert ok(text) and whole.choices[0].finish_reason == "stop", (extra, text)
        chunks = list(c.completions.create(model=model, prompt="Answer:", max_tokens=80, temperature=0,
                                           extra_body=extra, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text


def test_bad_constraints_are_400_naming_the_field(serve_url):
    model = model_id(client(serve_url))
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}},
        "response_format.json_schema.schema"),
        ({"guided_regex": "(a{100}){100}{100}"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "x"}}, "structured_outputs")]
    for extra, field in bad:
        r = httpx.post(serve_url + "/v1/chat/completions", timeout=60,
                       json={"model": model, "messages": MESSAGES, "max_tokens": 5, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
    with pytest.raises(openai.BadRequestError):
        client(serve_url).chat.completions.create(model=model, messages=MESSAGES, max_tokens=5,
                                                  extra_body={"guided_grammar": "start: nowhere"})
    metrics = httpx.get(serve_url + "/metrics").text
    for name in (M.GUIDED_COMPILES, M.GUIDED_CACHE_HITS, M.GUIDED_MASK_SECONDS, M.GUIDED_CONSTRAINED_ROWS,
                 M.SAMPLED_ROWS):
        assert re.search(rf"^{name} [0-9.e+]+$", metrics, re.M), name


def test_bench_structured_checks_every_answer(serve_url):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "structured", "--endpoint",
                           serve_url,
                           "--num-requests", "10", "--concurrency", "4", "--max-tokens", "80"],
                          capture_output=True, text=True, timeout=300)
    # A random model may run a json_object or the whitespace trap to max_tokens (exit 1); never an invalid answer.
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "INVALID" not in done.stderr and "| regex | 2 | 2 | 2 |" in done.stdout, done.stdout
    assert "chat.completions.parse(response_format=Invoice): Invoice" in done.stdout
    assert "whitespace beyond the separators: []" in done.stdout, done.stdout
