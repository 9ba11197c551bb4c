"""Tool calling against `pagedserve serve` (tiny random Llama, the real tokenizer and chat template):
required and named calls, streamed and not, every call parsing and validating against its schema with
streamed deltas equal to the non-streamed calls; parallel_tool_calls false; a two-turn loop; the
Responses API with a function tool; and the OpenAI Agents SDK (a framework not written here) running a
tool-calling loop to completion over both chat completions and responses.

A random model writes whatever the grammar allows, so these show the constraint, not the model: every
call it can write is well formed, and it cannot call on past tool_grammar.MAX_CALLS.
PAGEDSERVE_TOOL_PROMPTS=100 repeats the checks over 100 prompts each; PAGEDSERVE_TOOL_MODEL=default runs them on
the bundled SmolLM2 instead (its template has no tools block, so this is the documented fallback format).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from typing import Literal

import jsonschema
import openai
import pytest

from tests.e2e.openai_checks import model_id
from tests.e2e.test_serve import served

PROMPTS = int(os.environ.get("PAGEDSERVE_TOOL_PROMPTS", "2"))
# Bounded strings and numbers: a random model's arguments must end well within max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["C", "F"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book_table", "parameters": {
    "type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 20},
                                     "names": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 3}},
    "required": ["guests", "names"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, BOOK)}
# Room for MAX_CALLS calls: a random model, free to call again after each call, often does.
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def serve_url(tiny_llama_dir):
    with served(os.environ.get("PAGEDSERVE_TOOL_MODEL", tiny_llama_dir), "--max-model-len", "1024") as url:
        yield url


def client(base_url: str) -> openai.OpenAI:
    # A random model may write MAX_CALLS calls (hundreds of tokens): on a loaded 2-core machine that is
    # minutes, not the shared checks' two.
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}: plan an evening in city number {i}."}]


def check_calls(calls: list[tuple[str, str]], allowed: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def stream_calls(c, **kw) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list] = {}
    reason = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or ():
                if d.id is not None:
                    calls[d.index] = [d.function.name, d.function.arguments]
                else:
                    calls[d.index][1] += d.function.arguments
    return [tuple(calls[i]) for i in sorted(calls)], reason


def one_prompt(c, model: str, i: int, tool_choice, parallel: bool) -> None:
    """Prompt i, whole and streamed: the calls parse, validate, and the stream's deltas rebuild them."""
    allowed = {"get_weather", "book_table"} if tool_choice == "required" else {tool_choice["function"]["name"]}
    kw = dict(model=model, messages=question(i), tools=[WEATHER, BOOK], tool_choice=tool_choice,
              parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=0)
    whole = c.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls", whole
    calls = [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
    check_calls(calls, allowed)
    if not parallel or tool_choice != "required":
        assert len(calls) == 1  # one call, and generation ended right after it
    streamed, reason = stream_calls(c, **kw)
    assert streamed == calls and reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_parse_validate_and_stream_identically(serve_url, choice):
    c = client(serve_url)
    model = model_id(c)
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "book_table"}}
    # Prompt 0 may call in parallel (up to MAX_CALLS calls); the rest one call each (parallel_tool_calls
    # false), which keeps a random model's answers short. Four at a time, as clients would send them.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: one_prompt(c, model, i, tool_choice, parallel=i == 0), range(PROMPTS)))


def test_a_two_turn_loop_and_the_responses_api(serve_url):
    c = client(serve_url)
    model = model_id(c)
    msgs = question(0)
    first = c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    second = c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")

    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMAS["get_weather"], "strict": True}
    r = c.responses.create(model=model, input="Weather in Paris?", tools=[tool], tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=MAX_TOKENS, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    check_calls([(i.name, i.arguments) for i in calls], {"get_weather"})
    with c.responses.stream(model=model, input="Weather in Paris?", tools=[tool], tool_choice="required",
                            parallel_tool_calls=False, max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and final.status == "completed"
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [
        (i.name, i.arguments) for i in calls]


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_the_openai_agents_sdk_runs_a_tool_loop_to_completion(serve_url, api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[dict] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The weather in a city.

        Args:
            city: the city.
            unit: C or F.
        """
        calls.append({"city": city, "unit": unit})
        return f"sunny in {city}"

    async def run() -> object:
        openai_client = AsyncOpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0)
        name = (await openai_client.models.list()).data[0].id
        model = (agents.OpenAIChatCompletionsModel(name, openai_client) if api == "chat_completions"
                 else agents.OpenAIResponsesModel(name, openai_client))
        # Over responses, a random model's free text after the call would end at max_output_tokens, which
        # the SDK takes as a failed run: there the tool's result ends it (tests/replica covers the full
        # loop over responses with a scripted model).
        behaviour = "run_llm_again" if api == "chat_completions" else "stop_on_first_tool"
        agent = agents.Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather],
                             model=model, tool_use_behavior=behaviour, model_settings=agents.ModelSettings(
                                 tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0))
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=8)

    result = asyncio.run(run())
    assert calls, "the agent never called its tool"
    # After the call the SDK resets tool_choice to auto, and the model's text ends the run.
    assert isinstance(result.final_output, str)
