"""Greedy parity of the real SmolLM2-135M (float32) with transformers, under continuous batching.

Eight prompts of 5 to 600+ tokens (chat and plain) run together with a token budget smaller than the
longest prompt (chunked prefill) and a KV pool small enough to force preemption; then again with
prefix caching and a shared 200-token system prompt. Every request must match `generate()` run alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.slow

# Real prose for the prompts, kept in the repository so every machine runs the same inputs.
TEXT = (Path(__file__).parent / "data" / "design_brief.md").read_text()
assert len(TEXT) > 9000


def _prompts(tok) -> list[list[int]]:
    return [
        tok.encode("Hi there, how are you?"),
        tok.encode("The quick brown fox jumps over the lazy dog. " * 3),
        tok.apply_chat_template([{"role": "user", "content": "Write a haiku about autumn."}]),
        tok.encode(" ".join(f"item{i}" for i in range(120))),
        tok.encode(TEXT[:2600]),
        tok.apply_chat_template([{"role": "user", "content": "Summarise:\n" + TEXT[3000:4400]}]),
        tok.encode("def fibonacci(n):"),
        tok.encode(TEXT[5000:5400]),
    ]


@pytest.fixture(scope="module")
def constrained_llm():
    return LLM(dtype="float32", num_kv_blocks=90, max_num_batched_tokens=256, enable_prefix_caching=False)


def test_greedy_parity_with_chunked_prefill_and_preemption(constrained_llm, hf_smollm2):
    llm = constrained_llm
    prompts = _prompts(llm.tokenizer)
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 5 and max(lengths) >= 600 and max(lengths) > 256
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_smollm2, p, 32), f"prompt of {len(p)} tokens diverged"


def test_greedy_parity_with_shared_system_prompt_and_prefix_caching(hf_smollm2):
    llm = LLM(dtype="float32", num_kv_blocks=120, max_num_batched_tokens=256, enable_prefix_caching=True)
    tok = llm.tokenizer
    system = tok.decode(tok.encode(TEXT[6000:9000])[:200])
    questions = ["What is a block?", "Who owns the queue?", "How are prefixes shared?", "Name a metric.",
                 "What does the router do?", "Explain preemption.", "What is W3?", "Which hash is used?"]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    assert all(len(p) >= 200 for p in prompts)
    first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)
    outs = first + llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                use_tqdm=False)
    assert all(o.num_cached_tokens >= 192 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf_smollm2, p, 32)
