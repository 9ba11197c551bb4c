"""Engine fixtures: tiny random models of each supported architecture, and the real SmolLM2 in float32."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.model_files.model_source import resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_model(out: Path, arch: str = "llama", perturb_norms: bool = False, **overrides) -> Path:
    """A 2-layer random model with SmolLM2's tokenizer, saved by transformers' own classes. Weights are
    drawn wide (std 0.2) so greedy choices are not near-ties that rounding could flip."""
    import torch
    import transformers

    src = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096, initializer_range=0.2,
                  eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    common.update(overrides)
    cls = TINY_CLASSES[arch]
    config = getattr(transformers, cls[0])(**common)
    torch.manual_seed(1234)
    model = getattr(transformers, cls[1])(config).to(torch.float32).eval()
    if perturb_norms:
        # transformers initialises norms to 1 (or 0 for Gemma's 1 + w) and biases to 0: a loader that dropped
        # them would still match. Drawn here, every one of them changes the output.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


# arch -> (transformers config class, model class)
TINY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # No module of their own: the transformers backend serves them.
    "olmo": ("OlmoConfig", "OlmoForCausalLM"), "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def smollm2_fp32():
    from services import LLM

    return LLM(dtype="float32", num_kv_blocks=2048)


@pytest.fixture(scope="session")
def hf_smollm2():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_matches(model, prompt: list[int], got: list[int], what: str, tie_tolerance: float = 1e-5) -> None:
    """`got` equals transformers' greedy continuation of `prompt`, except after a tie in transformers' own
    logits (its top two within `tie_tolerance`, relative), the only acceptable difference: the test says so
    when it happens and compares no further (the two continuations then follow different tokens)."""
    import warnings

    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(got), do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, len(prompt):].tolist()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a == b:
            continue
        scores = out.scores[i][0].float()
        gap = float(scores[b] - scores[a])
        if gap <= tie_tolerance * max(1.0, float(scores[b].abs())):
            warnings.warn(f"{what}: a tie in transformers' logits at generated token {i} ({b} vs {a}, gap {gap:.2e}); "
                          "compared up to it", stacklevel=2)
            return
        raise AssertionError(f"{what}: generated token {i} is {a}, transformers' {b} (logit gap {gap:.3g}); "
                             f"got {got}, transformers {want}")
