"""Greedy parity with transformers for each supported architecture, on tiny random models (float32),
with chunked prefill and preemption active."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, make_tiny_model

VARIANTS = {
    "llama-gqa-tied": ("llama", {}),
    "llama3-rope-scaling-untied": ("llama", {
        "tie_word_embeddings": False, "num_key_value_heads": 1,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-qkv-bias": ("qwen2", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    model_dir = make_tiny_model(tmp_path / variant, arch, **overrides)
    rng = random.Random(sum(map(ord, variant)))  # fixed per variant: exact equality, no lucky draws
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (3, 17, 40, 150, 260)]
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=30,
              max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0, "the pool is sized so that preemption happens"
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), f"prompt of {len(p)} tokens diverged"


def test_bfloat16_stays_close_to_float32(tiny_model_dir):
    prompt = list(range(1000, 1040))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = LLM(model=str(tiny_model_dir), dtype="float32").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    b = LLM(model=str(tiny_model_dir), dtype="bfloat16").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids[0] == b.token_ids[0]
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.3  # wide random weights amplify rounding
