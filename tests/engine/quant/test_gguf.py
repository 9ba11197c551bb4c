"""GGUF files served as they are: each ggml block type decoded exactly as the `gguf` package dequantizes it,
and a small GGUF model (every served type in one file) greedy-identical in float32 to transformers loading
the same file."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from services.engine.quant.formats.gguf_tensors import decode
from services.engine.quant.panel_weight import PanelWeight
from tests.engine.conftest import hf_greedy
from tests.engine.quant.gguf_writer import dequantize_reference, random_blocks, write_tiny_gguf

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_block_decoding_matches_the_gguf_package(kind):
    raw = random_blocks(kind, 70, 512, np.random.default_rng(kind.value))
    qw = decode(kind.name, torch.from_numpy(raw), 512, kind.name)
    want = dequantize_reference(kind, raw)
    assert torch.equal(qw.dequantize(), want)
    assert torch.equal(PanelWeight.of(qw).dequantize(), want)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf"
    types = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
             "ffn_gate": Q.Q5_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q4_K}
    return write_tiny_gguf(path, types)


def test_a_gguf_model_kept_quantized_matches_transformers(tiny_gguf):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (4, 30, 70)]
    llm = LLM(model=str(tiny_gguf), quantization="gguf", dtype="float32", num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                              dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16), f"prompt of {len(p)} tokens diverged"


def test_bfloat16_gguf_stays_close_to_float32(tiny_gguf):
    prompt = list(range(1000, 1040))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = LLM(model=str(tiny_gguf), quantization="gguf", dtype="float32").generate([prompt], params,
                                                                                 use_tqdm=False)[0].outputs[0]
    b = LLM(model=str(tiny_gguf), quantization="gguf", dtype="bfloat16").generate([prompt], params,
                                                                                  use_tqdm=False)[0].outputs[0]
    assert a.token_ids[0] == b.token_ids[0]
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.3
