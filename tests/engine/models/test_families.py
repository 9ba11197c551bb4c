"""Greedy parity with transformers for every family module, on tiny random checkpoints saved by
transformers' own config and model classes (float32): prompts longer than every sliding window, windows
small enough to slide several blocks, chunked prefill, prefix hits and preemption forced.

Each variant turns on what its family does differently (biases, activations, q/k norms, Gemma's norms
and soft-caps, per-layer RoPE, partial rotary, LongRoPE, sliding windows), with norms and biases drawn
away from their initial values so that a loader dropping one would be caught. A tie in transformers' own
logits is the only acceptable difference: none occurs with these seeds (the test would say so)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, make_tiny_model

WINDOW = 10  # with blocks of 4 tokens: a window that slides over a block every 4 tokens, never block-aligned
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 2.8, 5.0, 9.5]}

VARIANTS = {
    # Llama fields that were silently ignored before: mlp_bias and hidden_act (and attention biases).
    "llama-biases-gelu": ("llama", {"mlp_bias": True, "attention_bias": True, "hidden_act": "gelu_new",
                                    "tie_word_embeddings": False}, {}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}, {}),
    # Sliding window on layer 1 only (max_window_layers=1): two KV groups, one full and one windowed.
    "qwen2-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                                      "num_hidden_layers": 2}, {}),
    "qwen3-head-dim": ("qwen3", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                  "original_max_position_embeddings": 64}}, {}),
    "gemma2-softcaps": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                                   "final_logit_softcapping": 5.0, "sliding_window": WINDOW}, {}),
    # Two local layers and a global one, each kind its own RoPE (the global one linearly scaled).
    "gemma3-local-global": ("gemma3", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "num_hidden_layers": 3, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}, {}),
    # Partial rotary, LongRoPE past its original length (long factors, as transformers for these prompts),
    # a window over every layer, fused qkv_proj / gate_up_proj in the checkpoint.
    "phi3-longrope-window": ("phi3", {
        "partial_rotary_factor": 0.5, "rope_scaling": LONGROPE, "original_max_position_embeddings": 20,
        "max_position_embeddings": 512, "sliding_window": 2 * WINDOW, "num_key_value_heads": 4,
        "pad_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": False}, {}),
    # Mixtures of experts (services/engine/layers/moe.py), each family's routing: Mixtral's softmax over
    # every expert then the top k renormalised, with a window; Qwen3-MoE without renormalising and a dense
    # first layer; DeepSeek-V3's sigmoid group-limited routing with shared experts, a dense first layer and
    # latent attention (layers/mla.py); gpt-oss's biased router, clamped SwiGLU (a small limit, so the
    # clamps bite), attention sinks, alternating windowed and full layers, and YaRN.
    "mixtral-moe-window": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
                           {}),
    "qwen3-moe-dense-first": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                            "head_dim": 16, "mlp_only_layers": [0], "norm_topk_prob": False}, {}),
    "deepseek-v3-mla": ("deepseek_v3", {
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "moe_intermediate_size": 32, "q_lora_rank": 24, "kv_lora_rank": 48,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, "num_key_value_heads": 4}, {}),
    "gpt-oss-sinks": ("gpt_oss", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 512, "rope_theta": 150000.0}}, {}),
    # The same model served within its original length: the short factors, as transformers.
    "phi3-longrope-short": ("phi3", {
        "partial_rotary_factor": 0.5, "rope_scaling": LONGROPE, "original_max_position_embeddings": 96,
        "max_position_embeddings": 512, "num_key_value_heads": 4, "pad_token_id": 0, "eos_token_id": 2}, {
        "max_model_len": 96}),
}
MAX_TOKENS = 12


def prompts_for(name: str, shortest: int) -> list[list[int]]:
    rng = random.Random(sum(map(ord, name)))  # fixed per variant: exact equality, no lucky draws
    shared = [rng.randrange(100, 49152) for _ in range(24)]  # six blocks of 4 every prompt starts with
    return [shared + [rng.randrange(100, 49152) for _ in range(n)] for n in (shortest, 19, 41, 3, 30)]


def generate(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # The first prompt alone, then the rest: their shared blocks come from the prefix cache.
    outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    return outs


def tiny(name: str, tmp_path_factory, hf_cache):
    arch, overrides, _ = VARIANTS[name]
    if name not in hf_cache:
        model_dir = make_tiny_model(tmp_path_factory.mktemp(name) / name, arch, perturb_norms=True, **overrides)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        shortest = 9 if VARIANTS[name][2].get("max_model_len") else 12
        prompts = prompts_for(name, shortest)
        hf_cache[name] = (model_dir, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts])
    return hf_cache[name]


def check(name: str, outs, prompts, want) -> None:
    for p, o, w in zip(prompts, outs, want, strict=True):
        assert o.outputs[0].token_ids == w, f"{name}: prompt of {len(p)} tokens diverged from transformers"


class ForcedPreemption:
    """A step hook that preempts the newest running sequence every few steps (sliding-window models free
    blocks as fast as they take them, so a small pool alone rarely preempts them) and checks the pool's
    accounting after every step."""

    def __init__(self, every: int = 5):
        self.every, self.steps = every, 0

    def __call__(self, core) -> None:
        self.steps += 1
        core.pool.check_invariants()
        if self.steps % self.every == 0 and core.scheduler.running:
            core.scheduler._preempt(core.scheduler.running[-1])  # what a step short of blocks does


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_matches_transformers(name, tmp_path_factory, hf_cache):
    model_dir, prompts, want = tiny(name, tmp_path_factory, hf_cache)
    # Blocks of 4 and chunks of 16 tokens; the later prompts' shared blocks are prefix hits, and preempted
    # sequences are recomputed (from the prefix cache where it still holds their blocks).
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=400,
              **VARIANTS[name][2])
    run_and_check(name, llm, prompts, want)


def run_and_check(name: str, llm: LLM, prompts, want) -> None:
    """Generate with preemption forced; transformers' tokens, prefix hits, and every block back."""
    llm.step_hook = ForcedPreemption()
    outs = generate(llm, prompts)
    for p, o, w in zip(prompts, outs, want, strict=True):
        assert o.outputs[0].token_ids == w, f"{name}: prompt of {len(p)} tokens diverged from transformers"
    assert all(o.num_cached_tokens >= 16 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    assert llm.core.scheduler.num_preemptions >= 2
    assert llm.core.pool.num_in_use == 0, "every block is back in the pool"


# Tensor parallelism over two ranks (rank 0 here, rank 1 a real `pagedserve engine-worker` over gloo), for
# the variants whose sharding differs: Gemma's norms after the reduced outputs and its soft-caps, Phi-3's
# fused checkpoint tensors split by rows, Llama's MLP biases (gate/up column-parallel, down's added once),
# and the KV groups' tables sent to every rank.
# The expert layers split like dense MLPs (services/engine/models/expert_weights.py) and MLA by heads with
# the latent cache replicated; gpt-oss's sinks per query head.
TP_VARIANTS = ["gemma2-softcaps", "llama-biases-gelu", "phi3-longrope-window", "qwen3-moe-dense-first",
               "deepseek-v3-mla", "gpt-oss-sinks",
               # and every other dense family: per-head q/k norms split with the heads, windowed KV groups
               "gemma3-local-global", "qwen3-head-dim", "mistral-window", "qwen2-window-layers"]


@pytest.mark.parametrize("name", TP_VARIANTS)
def test_two_ranks_match_transformers(name, tmp_path_factory, hf_cache):
    model_dir, prompts, want = tiny(name, tmp_path_factory, hf_cache)
    with LLM(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=400,
             tensor_parallel_size=2, **VARIANTS[name][2]) as llm:
        llm.step_hook = ForcedPreemption()
        outs = generate(llm, prompts)
        assert llm.core.scheduler.num_preemptions >= 2
    for p, o, w in zip(prompts, outs, want, strict=True):
        assert o.outputs[0].token_ids == w, f"{name}: prompt of {len(p)} tokens diverged at 2 ranks"
    assert all(o.num_cached_tokens >= 16 for o in outs[1:]), [o.num_cached_tokens for o in outs]


# The whole engine on the other backends: the Triton kernels (the interpreter, float32: it runs no bfloat16
# dot; too slow for every family, tests/kernels/test_attention_options.py covers the options one by one) on
# windows, soft-caps and two KV groups, and the PyTorch references on several groups and partial rotary.
@pytest.mark.parametrize("backend,name", [("triton", "gemma2-softcaps"), ("reference", "gemma3-local-global"),
                                          ("reference", "phi3-longrope-window"), ("reference", "gpt-oss-sinks"),
                                          ("reference", "deepseek-v3-mla"), ("triton", "deepseek-v3-mla"),
                                          ("triton", "mixtral-moe-window")])
def test_other_backends_match_transformers(backend, name, tmp_path_factory, hf_cache):
    model_dir, prompts, want = tiny(name, tmp_path_factory, hf_cache)
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=400,
              attention_backend=backend, **VARIANTS[name][2])
    assert llm.runner.model.attn.name == backend
    experts = [layer.moe for layer in llm.runner.model.layers if layer.moe is not None]
    # Expert layers follow the backend: Triton's grouped kernel under the interpreter, else the CPU path.
    assert all((e.packed is None) == (backend == "triton") for e in experts)
    run_and_check(f"{name} on {backend}", llm, prompts, want)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bfloat16_stays_close_to_float32(name, tmp_path_factory, hf_cache):
    """bfloat16 on the CPU backend (the C++ kernels: fused norms, partial RoPE, windowed and soft-capped
    decode) within the Llama tests' tolerance: the same first token, its logprob within 0.3."""
    model_dir, prompts, _ = tiny(name, tmp_path_factory, hf_cache)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    got = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(model_dir), dtype=dtype, block_size=4, max_num_batched_tokens=16, num_kv_blocks=400,
                  **VARIANTS[name][2])
        got[dtype] = [o.outputs[0] for o in llm.generate(prompts[2:3], params, use_tqdm=False)]
    a, b = got["float32"][0], got["bfloat16"][0]
    if a.token_ids[0] != b.token_ids[0]:
        # A near-tie bfloat16 flips (a tiny random MoE's routing is fragile): only if transformers' own bfloat16
        # model flips it to the same token.
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
        with torch.no_grad():
            hf_token = int(hf(torch.tensor([prompts[2]])).logits[0, -1].argmax())
        assert b.token_ids[0] == hf_token, (a.token_ids[0], b.token_ids[0], hf_token)
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.3
