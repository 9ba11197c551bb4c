"""`pagedserve serve` as a real process on a tiny checkpoint of a family module (Gemma 2's windows and
soft-caps) and of an architecture with no module (OLMo, the transformers path): the official openai client
gets transformers' greedy tokens for a prompt longer than the windows, a chat through the checkpoint's
template with chat_template_kwargs, and /v1/models says which path runs it. Every family module is served
the same way in tests/engine/models/test_families_served.py."""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.openai_checks import client
from tests.e2e.test_serve import served
from tests.engine.conftest import hf_greedy, make_tiny_model

pytest.importorskip("services.scheduler.async_scheduler")

FAMILIES = {
    "gemma2": ({"head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 5.0, "sliding_window": 10}, "pagedserve"),
    "olmo": ({}, "transformers"),
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_openai_client_gets_transformers_tokens(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    overrides, path = FAMILIES[arch]
    model_dir = make_tiny_model(tmp_path / arch, arch, perturb_norms=True, **overrides)
    rng = random.Random(len(arch))
    prompt = [rng.randrange(100, 49152) for _ in range(40)]  # four windows long
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    want = hf_greedy(hf, prompt, 8)
    with served(model_dir, "--block-size", "4", "--max-num-batched-tokens", "16") as url:
        c = client(url)
        entry = c.models.list().data[0]
        assert entry.model_extra["model_path"] == path
        out = c.completions.create(model=entry.id, prompt=prompt, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        assert out.choices[0].text == _text(model_dir, want)
        chat = c.chat.completions.create(model=entry.id, messages=[{"role": "user", "content": "Hi there"}],
                                         max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert chat.choices[0].finish_reason in ("length", "stop")


def _text(model_dir, ids: list[int]) -> str:
    from services.model_files.tokenizer import ModelTokenizer

    return ModelTokenizer(model_dir).decode(ids)
