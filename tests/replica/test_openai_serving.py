"""The OpenAI HTTP layer over a scripted engine: formats with the real `openai` client, every kind of
bad input as a 4xx error object, engine failures as 503s, and disconnects as aborts."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from services.contracts.step_protocol import TokenLogprobs
from services.replica.app import create_replica_app
from services.replica.metrics import SchedulerMetrics
from services.replica.openai_serving import OpenAIServing, ServingConfig
from services.request.errors import InvalidRequestError
from services.scheduler.async_scheduler import QueueFullError
from services.scheduler.request_output import CompletionOutput, RequestOutput
from services.structured_output.compiler import GrammarCompiler
from tests.conftest import AppServer

MODEL = "tiny"
MAX_LEN = 256


class ScriptedEngine:
    """Emits a fixed text one token per step; records what was aborted."""

    def __init__(self, tokenizer, delay: float = 0.0):
        self.tokenizer = tokenizer
        self.words = tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta iota kappa" * 4)
        self.delay = delay
        self.healthy = True
        self.fail_at: int | None = None
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.limit, self.held = 1 << 30, 0

    async def generate(self, rid, prompt, params):
        if max(prompt) >= 49152:
            raise InvalidRequestError("prompt", "token id outside the vocabulary")
        self.active.add(rid)
        try:
            for step in range(1, params.max_tokens + 1):
                await asyncio.sleep(self.delay)
                if self.fail_at is not None and step >= self.fail_at:
                    yield RequestOutput(rid, prompt, [CompletionOutput(0, "", [], "error")], True, error="boom")
                    return
                ids = self.words[:step]
                done = step == params.max_tokens
                lps = [TokenLogprobs(-0.1, [ids[0], 5], [-0.1, -2.0])] * step if params.logprobs is not None else None
                outs = [CompletionOutput(i, self.tokenizer.decode(ids), ids, "length" if done else None, None, lps)
                        for i in range(params.n)]
                yield RequestOutput(rid, prompt, outs, done, num_cached_tokens=16)
        finally:
            self.active.discard(rid)

    def abort(self, rid):
        self.aborted.append(rid)

    def admit(self, num_seqs):
        if self.held + num_seqs > self.limit:
            raise QueueFullError(f"{self.held} held")
        self.held += num_seqs
        engine = self

        class _Held:
            def release(self):
                engine.held -= num_seqs

        return _Held()


@pytest.fixture
def api(smol_tokenizer):
    engine = ScriptedEngine(smol_tokenizer)
    grammars = GrammarCompiler(lambda: smol_tokenizer.fast.to_str(), smol_tokenizer.vocab_size)
    serving = OpenAIServing(engine, smol_tokenizer, ServingConfig(MODEL, MAX_LEN, max_body_bytes=1 << 20),
                            SchedulerMetrics(lambda: None), grammars)
    app = create_replica_app(serving, SchedulerMetrics(lambda: None), lambda: {"healthy": engine.healthy})
    with AppServer(app) as server:
        yield engine, server.url


def test_openai_client_completions_chat_stream_n_logprobs_usage(api):
    engine, url = api
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2, logprobs=2)
    assert [ch.index for ch in c.choices] == [0, 1]
    assert c.choices[0].text == " alpha beta gamma" and c.choices[0].finish_reason == "length"
    assert len(c.choices[0].logprobs.tokens) == 3 and c.choices[0].logprobs.text_offset[0] == 0
    assert c.usage.completion_tokens == 6 and c.usage.prompt_tokens_details.cached_tokens == 16

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == " alpha beta"
    assert chat.choices[0].logprobs.content[1].token == " beta"

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == " alpha beta gamma delta"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4

    comp_stream = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, stream=True)
    by_index: dict[int, str] = {}
    for ch in comp_stream:
        for choice in ch.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert by_index == {0: " alpha beta", 1: " alpha beta"}
    assert client.models.list().data[0].id == MODEL


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_MISTAKES = [
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [F, F]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"functions": [{"name": "f"}]}, "functions"),
]
BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**15}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 400}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -2.01}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"05": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 1, "n": 2}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    # The poison values of issue 14: each once ended a replica's every request, or was a 500.
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1, "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1, "top_k": 3 * 2**62}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1, "top_k": 2**63 - 1}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": [2**32]}, 400, "prompt.0"),
    ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], [2**40]]}, 400, "prompt.1.0"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff x"]}', 400, "prompt.1"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x"] * 10_000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x"] * 200, "n": 8}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    *[("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra}, 400, param)
      for extra, param in TOOL_MISTAKES],
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_nope", "content": "42"}]},
     400, "messages.1.tool_call_id"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_grammar": "start: nowhere"}, 400, "guided_grammar"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "((a{100}){100}){100}"}},
     400, "structured_outputs.regex"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "extra": 1}]},
     400, "messages.0.extra"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_input_is_a_4xx_error_object(api, path, body, status, param):
    _, url = api
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(url + path, timeout=10, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param, err


ACCEPTED_EXTREMES = [
    {"temperature": 1e-320}, {"temperature": 1e-6}, {"temperature": 1e300}, {"top_p": 1e-50}, {"top_k": 49152},
    {"seed": -(2**63)}, {"seed": 2**63 - 1}, {"response_format": {"type": "text"}}, {"tool_choice": "none"},
    {"stream_options": {"include_usage": True}, "stream": True}, {"include_stop_str_in_output": True},
    {"cache_salt": "tenant-a"}, {"user": "u1", "metadata": {"k": "v"}}, {"response_format": {"type": "json_object"}},
    {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 100.0},
    {"repetition_penalty": 0.01}, {"min_p": 1.0}, {"logit_bias": {"0": -100, "49151": 100}},
]


@pytest.mark.parametrize("extra", ACCEPTED_EXTREMES)
def test_extreme_but_valid_values_are_served(api, extra):
    _, url = api
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text


def test_the_schema_is_published_with_every_range(api):
    _, url = api
    doc = httpx.get(url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"] == "#/components/schemas/ChatCompletionRequest"
    props = schemas["CompletionRequest"]["properties"]
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 128)
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    seed = [t for t in props["seed"]["anyOf"] if t.get("type") == "integer"][0]
    assert seed["minimum"] == -(2**63) and seed["maximum"] == 2**63 - 1


def test_huge_body_is_413_and_other_requests_are_unaffected(api):
    _, url = api
    big = b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}'
    r = httpx.post(url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=10)
    assert ok.status_code == 200
    assert httpx.get(url + "/nope", timeout=10).json()["error"]["type"] == "not_found_error"


def test_engine_failure_is_503_before_first_byte_and_an_error_event_after(api):
    engine, url = api
    engine.fail_at = 1
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    engine.fail_at = 3
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True))
    engine.healthy = False
    assert httpx.get(url + "/health", timeout=10).status_code == 503


def test_client_disconnect_aborts_the_engine_request(api):
    engine, url = api
    engine.delay = 0.05
    with httpx.stream("POST", url + "/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.monotonic() + 5
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.active and len(engine.aborted) == 1

    async def leave_early():
        async with httpx.AsyncClient(timeout=10) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(url + "/v1/completions", timeout=0.3,
                             json={"model": MODEL, "prompt": "x", "max_tokens": 200})

    asyncio.run(leave_early())
    deadline = time.monotonic() + 5
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.active and len(engine.aborted) == 2


def test_a_full_queue_is_a_503_with_retry_after_and_room_comes_back(api):
    engine, url = api
    engine.limit, engine.delay = 3, 0.05
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=20) as client:
        with client.stream("POST", url + "/v1/completions", json={**body, "n": 2}) as first:
            assert first.status_code == 200
            r = client.post(url + "/v1/completions", json={**body, "n": 2, "stream": False})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert client.post(url + "/v1/completions", json={**body, "stream": False}).status_code == 200
            first.read()
        # A finished stream and a client that leaves mid-stream both give their room back.
        with client.stream("POST", url + "/v1/completions", json={**body, "n": 3}) as s:
            next(s.iter_lines())
        deadline = time.monotonic() + 5
        while engine.held and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.held == 0
        assert client.post(url + "/v1/completions", json={**body, "n": 3, "stream": False}).status_code == 200


def test_echo_prepends_the_prompt_streamed_or_not_and_best_of_is_admitted(api):
    _, url = api
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=3, echo=True)
    assert [c.text for c in whole.choices] == ["Hello alpha beta gamma", "Bye alpha beta gamma"]
    streamed: dict[int, str] = {}
    for ch in client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=3, echo=True, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: whole.choices[0].text, 1: whole.choices[1].text}
    best = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=1, best_of=3, presence_penalty=1,
                                     frequency_penalty=-1, logit_bias={"5": -100}, extra_body={"min_p": 0.1,
                                                                                             "repetition_penalty": 1.2})
    assert len(best.choices) == 1


def test_tokenize_and_detokenize_on_the_replica(api, smol_tokenizer):
    _, url = api
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    ids = smol_tokenizer.encode("Hello world")
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                                                 "token_strs": smol_tokenizer.token_strings(ids)}
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == smol_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}
    assert httpx.post(url + "/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    bad = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "x", "add_special_tokens": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
