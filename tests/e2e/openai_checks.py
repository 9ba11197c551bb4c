"""What the official `openai` client must be able to do against any pagedserve endpoint (the router of a
cluster, or `pagedserve serve`): shared by the end-to-end tests of both."""

from __future__ import annotations

import httpx
import openai

LONG_SYSTEM = "You are a terse assistant for a lighthouse keeper. Answer in one line. " * 8


def client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def model_id(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def check_chat_and_completions(c: openai.OpenAI) -> None:
    model = model_id(c)
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Status?"}]
    first = c.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0, seed=1)
    assert first.choices[0].finish_reason in ("length", "stop")
    assert 1 <= first.usage.completion_tokens <= 5 and first.usage.prompt_tokens > 64
    again = c.chat.completions.create(model=model, messages=msgs, max_tokens=5, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy is greedy
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # the system prompt came from the cache

    stream = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert text == c.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                             temperature=0).choices[0].message.content

    two = c.completions.create(model=model, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=7)
    assert sorted(ch.index for ch in two.choices) == [0, 1] and two.usage.completion_tokens <= 12
    lp = c.chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                   top_logprobs=2)
    assert len(lp.choices[0].logprobs.content) == lp.usage.completion_tokens
    assert len(lp.choices[0].logprobs.content[0].top_logprobs) == 2


def check_stop_strings(c: openai.OpenAI) -> None:
    """Stop strings of 3 to 12 characters (they span several tokens) cut the text, and what a stream
    shows, concatenated, is exactly the whole answer: n > 1, include_stop_str_in_output, min_tokens."""
    model = model_id(c)
    base = c.completions.create(model=model, prompt="The list goes", max_tokens=24, temperature=0, n=1)
    text = base.choices[0].text
    checked = 0
    for at, length in ((len(text) // 3, 3), (len(text) // 2, 7), (len(text) // 4, 12)):
        stop = text[at:at + length]
        if not stop.strip() or len(stop) < length:
            continue  # a random model may emit whitespace there; nothing meaningful to stop on
        for extra in ({}, {"include_stop_str_in_output": True}, {"min_tokens": 2}):
            kw = dict(model=model, prompt="The list goes", max_tokens=24, temperature=0, stop=[stop], n=2,
                      extra_body=extra)
            cut = c.completions.create(**kw)
            want = text[:text.index(stop) + (len(stop) if extra.get("include_stop_str_in_output") else 0)]
            streamed = ["", ""]
            for ch in c.completions.create(**kw, stream=True):
                for choice in ch.choices:
                    streamed[choice.index] += choice.text
            if "min_tokens" in extra:
                # A stop string inside the first min_tokens tokens is not applied: the cut may come later.
                want = cut.choices[0].text
                assert cut.usage.completion_tokens >= 2 * 2 and text.startswith(want[:len(text)])
            for i in (0, 1):
                assert cut.choices[i].finish_reason == "stop" and cut.choices[i].text == want, (stop, extra)
                assert streamed[i] == want, (stop, extra, streamed[i])
            checked += 1
    assert checked, f"no usable stop string in {text!r}"


def check_bad_input(base_url: str) -> None:
    url = base_url + "/v1/chat/completions"
    bad = [b"{nope", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
           {"model": "x"}, {"messages": "x"}]
    for body in bad:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(url, timeout=30, **kw)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], r.text


def kv_usage(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("pagedserve_kv_cache_usage_ratio "):
            return float(line.split()[1])
    raise AssertionError("pagedserve_kv_cache_usage_ratio not exported")


def check_sampling_surface(c: openai.OpenAI, base_url: str) -> None:
    """Penalties, logit_bias, min_p, best_of, echo, /tokenize and /detokenize end to end (the step
    protocol's PenaltySpec crosses the real transport where the engine is a process of its own)."""
    model = model_id(c)
    tok = httpx.post(base_url + "/tokenize", json={"model": model, "prompt": " the"}, timeout=30).json()
    forced = tok["tokens"][-1]
    biased = c.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100})
    assert biased.choices[0].text == httpx.post(base_url + "/detokenize", json={"tokens": [forced] * 4},
                                                timeout=30).json()["prompt"]
    kw = dict(model=model, prompt="tick tick tick", max_tokens=8, temperature=0.9, seed=4, frequency_penalty=1.5,
              presence_penalty=0.5, extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "ignore_eos": True})
    whole = c.completions.create(**kw).choices[0].text
    assert "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices) == whole
    plain = c.completions.create(model=model, prompt="Hello there", max_tokens=3, temperature=0).choices[0].text
    echoed = c.completions.create(model=model, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello there" + plain
    every = c.completions.create(model=model, prompt="Once", max_tokens=5, n=4, temperature=1.0, seed=3, logprobs=0,
                                 extra_body={"ignore_eos": True})
    best = c.completions.create(model=model, prompt="Once", max_tokens=5, n=2, best_of=4, temperature=1.0, seed=3,
                                extra_body={"ignore_eos": True})
    ranked = sorted(every.choices, key=lambda ch: -sum(ch.logprobs.token_logprobs))[:2]
    assert [ch.text for ch in best.choices] == [ch.text for ch in ranked]
