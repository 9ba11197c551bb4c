"""Every family module through `pagedserve serve` as a real process and the official openai client:
transformers' greedy text for prompts longer than every window (prefix hits among them), /v1/models naming
the path that runs it; for the expert families the per-expert routing counter on /metrics (every routed
token counted once per expert layer and chosen expert), and MLA's KV bytes per token from the engine's own
accounting against what the expanded keys and values would cost."""

from __future__ import annotations

import httpx
import pytest

from services import LLM
from services.model_files.tokenizer import ModelTokenizer
from tests.e2e.openai_checks import client, model_id
from tests.e2e.test_serve import served
from tests.engine.models.test_families import MAX_TOKENS, VARIANTS, tiny
from tests.engine.test_tensor_parallel import check_rank_killed_fails_clearly

EXPERT_VARIANTS = ["mixtral-moe-window", "qwen3-moe-dense-first", "deepseek-v3-mla", "gpt-oss-sinks"]
DENSE_VARIANTS = sorted(set(VARIANTS) - set(EXPERT_VARIANTS))


def expert_counts(metrics: str) -> dict[int, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("pagedserve_moe_expert_tokens_total{"):
            label, value = line.split()
            out[int(label.split('expert="')[1].split('"')[0])] = float(value)
    return out


def serve_args(name: str) -> list[str]:
    """Blocks of 4 and chunks of 16 tokens, as the engine tests: windows slide over several blocks, long
    prompts are prefilled in chunks. A variant's engine options become the same flags."""
    args = ["--block-size", "4", "--max-num-batched-tokens", "16"]
    for key, value in VARIANTS[name][2].items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def completions_equal_transformers(name: str, url: str, model_dir, prompts, want) -> int:
    """The first three prompts (the later two start with the first's cached blocks) through the openai
    client, greedy, each equal to transformers' text; the tokens that went through the forward."""
    tokenizer = ModelTokenizer(model_dir)
    c = client(url)
    computed = 0
    for p, w in zip(prompts[:3], want[:3], strict=True):
        r = c.completions.create(model=model_id(c), prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
        # A last token ending inside a UTF-8 character is held back from the text, as vLLM's detokenizer does
        # (the replacement characters a one-shot decode gives for its partial bytes are never sent).
        want_text = tokenizer.decode(w, True).rstrip("\ufffd")
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].text == want_text, f"{name}: diverged from transformers"
        # Tokens through the forward: the prompt past its cached blocks, then one per generated token
        # but the last (sampled, never fed back).
        computed += len(p) - r.usage.prompt_tokens_details.cached_tokens + MAX_TOKENS - 1
    assert computed < sum(len(p) for p in prompts[:3]) + 3 * (MAX_TOKENS - 1), f"{name}: no prefix hit"
    return computed


@pytest.mark.parametrize("name", DENSE_VARIANTS)
def test_dense_family_served_with_the_openai_client(name, tmp_path_factory, hf_cache):
    model_dir, prompts, want = tiny(name, tmp_path_factory, hf_cache)
    with served(model_dir, *serve_args(name)) as url:
        assert client(url).models.list().data[0].model_extra["model_path"] == "pagedserve"
        completions_equal_transformers(name, url, model_dir, prompts, want)


@pytest.mark.parametrize("name", EXPERT_VARIANTS)
def test_served_with_the_openai_client_and_the_expert_counter(name, tmp_path_factory, hf_cache):
    model_dir, prompts, want = tiny(name, tmp_path_factory, hf_cache)
    overrides = VARIANTS[name][1]
    num_experts = overrides.get("num_local_experts") or overrides.get("num_experts") or overrides["n_routed_experts"]
    top_k = overrides["num_experts_per_tok"]
    with served(model_dir, *serve_args(name)) as url:
        computed = completions_equal_transformers(name, url, model_dir, prompts, want)
        counts = expert_counts(httpx.get(url + "/metrics", timeout=10).text)
    assert sorted(counts) == list(range(num_experts)), counts
    moe_layers = {"qwen3-moe-dense-first": 1, "deepseek-v3-mla": 1}.get(name, 2)
    assert sum(counts.values()) == computed * top_k * moe_layers
    assert max(counts.values()) < sum(counts.values()), "routing spread over more than one expert"


def test_mla_caches_one_latent_per_token(tmp_path_factory, hf_cache):
    model_dir, _, _ = tiny("deepseek-v3-mla", tmp_path_factory, hf_cache)
    o = VARIANTS["deepseek-v3-mla"][1]
    llm = LLM(model=str(model_dir), dtype="bfloat16", block_size=4, num_kv_blocks=64)
    layers, heads = 2, 4
    latent = layers * (o["kv_lora_rank"] + o["qk_rope_head_dim"]) * 2  # bytes, one bfloat16 entry per layer
    expanded = layers * heads * (o["qk_rope_head_dim"] + o["qk_nope_head_dim"] + o["v_head_dim"]) * 2
    assert llm.runner.kv_bytes_per_token == latent
    assert llm.runner.arena.shape[1] == 1, "one cache tensor per layer: keys and values are the same entries"
    assert llm.runner.arena[0, 0].nbytes == 64 * 4 * latent // layers
    assert expanded / latent == pytest.approx(448 / 128)


def test_a_rank_killed_while_experts_run_fails_the_call_clearly(tmp_path_factory, hf_cache):
    """Experts split like dense MLPs end each layer in the same all-reduce: a rank lost mid-generation is
    the group's clear error, every KV block comes back."""
    model_dir, _, _ = tiny("qwen3-moe-dense-first", tmp_path_factory, hf_cache)
    check_rank_killed_fails_clearly(LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                        tensor_parallel_size=2))
