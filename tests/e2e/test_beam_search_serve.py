"""Beam search over HTTP (`pagedserve serve`, tiny random Llama, float32): vLLM's `use_beam_search` on
completions and chat returns the n best beams as n choices, equal to the offline `LLM.beam_search` on the
same weights; bad combinations are 400s naming the field, and no block is left behind."""

from __future__ import annotations

import httpx
import pytest

from services import LLM, BeamSearchParams
from tests.e2e.openai_checks import client, kv_usage, model_id
from tests.e2e.test_serve import serve_url  # noqa: F401  (the fixture: `pagedserve serve` of the tiny model)


def test_use_beam_search_equals_offline_beam_search(serve_url, tiny_llama_dir):  # noqa: F811
    c = client(serve_url)
    model = model_id(c)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8)
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    prompt = "Once upon a time"
    got = c.completions.create(model=model, prompt=prompt, n=3, max_tokens=8,
                               extra_body={"use_beam_search": True, "length_penalty": 0.5})
    want = llm.beam_search([prompt], params)[0].sequences
    assert [ch.text for ch in sorted(got.choices, key=lambda ch: ch.index)] == [s.output_text for s in want]
    assert got.usage.completion_tokens == sum(len(s.output_token_ids) for s in want)

    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = c.chat.completions.create(model=model, messages=msgs, n=2, max_tokens=6,
                                     extra_body={"use_beam_search": True, "early_stopping": True})
    ids = llm.tokenizer.apply_chat_template(msgs)
    want = llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=6, early_stopping=True))[0].sequences
    assert [ch.message.content for ch in chat.choices] == [s.output_text for s in want]
    assert kv_usage(httpx.get(serve_url + "/metrics").text) == 0


@pytest.mark.parametrize("extra,field", [
    ({"temperature": 0.8}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"stream": True}, "stream"),
    ({"seed": 1}, "seed"), ({"stop": ["x"]}, "stop"), ({"n": 9}, "n"), ({"max_tokens": 3000}, "max_tokens"),
    ({"early_stopping": "maybe"}, "early_stopping"), ({"length_penalty": "long"}, "length_penalty"),
])
def test_bad_beam_search_requests_are_400s_naming_the_field(serve_url, extra, field):  # noqa: F811
    body = {"model": model_id(client(serve_url)), "prompt": "x", "n": 2, "max_tokens": 4, "use_beam_search": True,
            **extra}
    r = httpx.post(serve_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
