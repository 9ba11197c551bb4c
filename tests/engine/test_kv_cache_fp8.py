"""The FP8 KV cache (--kv-cache-dtype fp8): twice the blocks in the same memory; the three attention backends
(PyTorch reference, C++ CPU, Triton under TRITON_INTERPRET=1) give the same greedy tokens over it; prefix
caching and preemption change nothing; the checkpoint's k_scale / v_scale are read."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services import LLM, SamplingParams
from services.engine.attention import PagedAttention
from services.engine.kv_cache_fp8 import to_fp8

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n=4, seed=3):
    rng = random.Random(seed)
    shared = [rng.randrange(100, 49152) for _ in range(40)]  # a common prefix, for the prefix cache
    return [shared + [rng.randrange(100, 49152) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def greedy(model_dir, **kw):
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_dtype="fp8", **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)], llm


def test_the_pool_holds_twice_the_blocks(tiny_model_dir):
    auto = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8M")
    fp8 = LLM(model=str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="8M", kv_cache_dtype="fp8")
    assert fp8.runner.arena.dtype == torch.float8_e4m3fn
    assert fp8.runner.num_kv_blocks == 2 * auto.runner.num_kv_blocks


def test_an_fp8_cache_equals_keys_and_values_rounded_through_e4m3(tiny_model_dir, monkeypatch):
    """The specification: attention over k and v rounded to e4m3 and back, in a float32 cache."""
    fp8, _ = greedy(tiny_model_dir, attention_backend="reference", num_kv_blocks=128, enable_prefix_caching=False)
    original = PagedAttention.__call__

    def rounded(self, q, k, v, k_cache, v_cache, meta, scale, kv_scales=None, **options):
        assert kv_scales is None and k_cache.dtype == torch.float32
        return original(self, q, to_fp8(k, 1.0).float(), to_fp8(v, 1.0).float(), k_cache, v_cache, meta, scale,
                        **options)

    monkeypatch.setattr(PagedAttention, "__call__", rounded)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", attention_backend="reference", num_kv_blocks=128,
              enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)] == fp8


def test_backends_agree_and_prefix_caching_and_preemption_change_nothing(tiny_model_dir):
    want, _ = greedy(tiny_model_dir, attention_backend="reference", num_kv_blocks=128, enable_prefix_caching=False)
    got, llm = greedy(tiny_model_dir, attention_backend="cpu", num_kv_blocks=128)
    assert got == want
    got, llm = greedy(tiny_model_dir, attention_backend="cpu", num_kv_blocks=9, max_num_batched_tokens=32)
    assert llm.core.scheduler.num_preemptions > 0, "the pool is sized so that preemption happens"
    assert got == want
    got, _ = greedy(tiny_model_dir, attention_backend="triton", num_kv_blocks=128, max_num_batched_tokens=64)
    assert got == want


def test_the_cache_holds_what_the_scales_say(tiny_model_dir, tmp_path):
    """k_scale / v_scale from the checkpoint: what the cache holds is e4m3(k / k_scale)."""
    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_model_dir, model_dir)
    f = next(model_dir.glob("*.safetensors"))
    tensors = load_file(str(f))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02 * (i + 1))
    save_file(tensors, str(f), metadata={"format": "pt"})
    ref, llm = greedy(model_dir, attention_backend="reference", num_kv_blocks=128, enable_prefix_caching=False)
    flat = [x for pair in llm.runner.model.kv_scales for x in pair]  # approx compares flat sequences only
    assert flat == pytest.approx([0.05, 0.02, 0.1, 0.04])
    # the scales fold into the softmax scale and the output on every backend alike
    assert greedy(model_dir, attention_backend="cpu", num_kv_blocks=128)[0] == ref
    x = torch.tensor([[[1.0, -100.0, 0.3]]])
    assert torch.equal(to_fp8(x, 0.5).float(), (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float())
