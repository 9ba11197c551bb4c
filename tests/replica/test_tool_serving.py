"""Tool calls and the Responses API over HTTP, with the official `openai` client, against a replica whose
engine writes a scripted answer token by token (the real tokenizer, so calls span many tokens): message
shapes, OpenAI's streaming deltas equal to the non-streamed calls, finish reasons, `responses.create` and
`responses.stream`, and each hostile tools request a 400 naming its field."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from services.openai_api.tool_prompt import render_call
from services.replica.app import create_replica_app
from services.replica.metrics import SchedulerMetrics
from services.replica.openai_serving import OpenAIServing, ServingConfig
from services.scheduler.request_output import CompletionOutput, RequestOutput
from services.structured_output.compiler import GrammarCompiler
from tests.conftest import AppServer

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ANSWER = ("Checking.\n" + render_call("get_weather", '{"city": "Paris {1}"}') + "\n"
          + render_call("add", '{"a": 1, "b": 2}'))


class TextEngine:
    """Writes `answer` one token per step; a stop string ends it as the scheduler would (cut before it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.answer = ANSWER
        self.after_results: str | None = None  # the answer once the prompt carries tool results
        self.healthy = True
        self.prompts: list[list[int]] = []

    async def generate(self, rid, prompt, params):
        self.prompts.append(prompt)
        answer = self.answer
        if self.after_results and "<tool_response>" in self.tokenizer.decode(prompt, skip_special_tokens=False):
            answer = self.after_results
        ids = self.tokenizer.encode(answer)
        for step in range(1, len(ids) + 1):
            await asyncio.sleep(0)
            text = self.tokenizer.decode(ids[:step])
            stop = next((s for s in params.stop_strings if s in text), None)
            done = step == len(ids) or stop is not None or step == params.max_tokens
            if stop is not None:
                text = text[:text.index(stop)]
            reason = ("stop" if step == len(ids) or stop else "length") if done else None
            yield RequestOutput(rid, prompt, [CompletionOutput(0, text, ids[:step], reason)], done)
            if done:
                return

    def abort(self, rid):
        pass

    def admit(self, num_seqs):
        class _Held:
            def release(self):
                pass

        return _Held()


@pytest.fixture(scope="module")
def api(smol_tokenizer):
    engine = TextEngine(smol_tokenizer)
    grammars = GrammarCompiler(smol_tokenizer.fast.to_str(), smol_tokenizer.vocab_size)
    serving = OpenAIServing(engine, smol_tokenizer, ServingConfig(MODEL, 4096), SchedulerMetrics(lambda: None),
                            grammars)
    app = create_replica_app(serving, SchedulerMetrics(lambda: None), lambda: {"healthy": True})
    with AppServer(app) as server:
        yield engine, server.url
    grammars.close()


@pytest.fixture
def client(api):
    engine, url = api
    engine.answer, engine.after_results = ANSWER, None
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def streamed_calls(chunks) -> tuple[str, list[dict], list]:
    content, calls, reasons = "", {}, []
    for ch in chunks:
        for choice in ch.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or ():
                if d.id is not None:
                    assert d.type == "function" and d.function.name and d.function.arguments == ""
                    assert d.index not in calls
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.function.name is None and d.id is None
                    calls[d.index]["arguments"] += d.function.arguments
    return content, [calls[i] for i in sorted(calls)], reasons


def test_calls_whole_and_streamed_are_the_same(client):
    msgs = [{"role": "user", "content": "Weather in Paris, and 1+2?"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, ADD])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris {1}"}), ("add", {"a": 1, "b": 2})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, ADD], stream=True))
    content, calls, reasons = streamed_calls(chunks)
    assert content == choice.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [r for r in reasons if r] == ["tool_calls"] and reasons[-1] == "tool_calls"
    # Each chunk carries one delta per choice; several chunks carry argument fragments.
    assert sum(1 for ch in chunks for c in ch.choices for d in c.delta.tool_calls or () if d.id is None) >= 2


def test_parallel_tool_calls_false_ends_after_the_first_call(client):
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, ADD], parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_without_tools_or_with_tool_choice_none_the_text_is_content(client):
    msgs = [{"role": "user", "content": "x"}]
    for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        r = client.chat.completions.create(model=MODEL, messages=msgs, **kw)
        assert r.choices[0].message.content == ANSWER and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_a_two_turn_loop_renders_the_call_and_its_result(api, client, smol_tokenizer):
    engine, _ = api
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    engine.answer = "It is sunny in Paris."
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny in Paris." and second.choices[0].finish_reason == "stop"
    prompt = smol_tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert render_call("get_weather", call.function.arguments) in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_responses_create_and_stream_with_a_function_tool(client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"],
            "strict": False}
    tools = [tool, {"type": "function", **ADD["function"]}]
    r = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.", tools=tools,
                                max_output_tokens=500)
    assert r.status == "completed" and r.object == "response"
    assert [i.type for i in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Checking."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris {1}"}
    assert r.usage.output_tokens > 10 and r.usage.input_tokens > 10

    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in r.output]
    assert final.output_text == r.output_text

    # The next turn: the call and its output go back in as input items.
    client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], tools=[tool])


def test_responses_text_only_and_truncated(api, client):
    engine, _ = api
    engine.answer = "Just words here."
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}])
    assert r.output_text == "Just words here." and r.status == "completed"
    short = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


RESPONSES_MISTAKES = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input.0.call_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools.0.parameters"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),  # one range for every endpoint (services.request.limits)
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}}, "text.format.schema"),
]


@pytest.mark.parametrize("extra,param", RESPONSES_MISTAKES)
def test_responses_mistakes_are_400s_naming_the_field(api, extra, param):
    _, url = api
    body = {"model": MODEL, "input": "hi", **extra}
    r = httpx.post(url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("api_kind", ["chat_completions", "responses"])
def test_the_openai_agents_sdk_completes_a_tool_loop(api, client, api_kind):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    engine, url = api
    engine.answer = render_call("get_weather", '{"city": "Paris"}')
    engine.after_results = "It is sunny in Paris."
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async def run():
        c = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        model = (agents.OpenAIChatCompletionsModel(MODEL, c) if api_kind == "chat_completions"
                 else agents.OpenAIResponsesModel(MODEL, c))
        agent = agents.Agent(name="forecaster", instructions="Use tools.", tools=[get_weather], model=model)
        return await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert seen == ["Paris"] and result.final_output == "It is sunny in Paris."


def test_parameters_that_cannot_compile_are_a_400_naming_that_tool(api):
    _, url = api
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}
    for path, body, param in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, bad]},
         "tools.1.function.parameters"),
        ("/v1/responses", {"input": "x", "tools": [{"type": "function", **WEATHER["function"]},
                                                   {"type": "function", **bad["function"]}]}, "tools.1.parameters"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                  "response_format": {"type": "json_object"}}, "response_format")]:
        r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
