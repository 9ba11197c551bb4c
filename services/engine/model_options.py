"""What an engine option needs from the model it runs, refused at start by name where the model cannot
give it: LoRA adapters, an FP8 KV cache and EAGLE-3 need a family module's model (not the transformers
path); LoRA and an FP8 cache do not reach expert layers or latent attention yet; a drafter's KV cache
follows one block table, so not a model with sliding-window KV groups."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.models.registry import MODULE_PATH


def cfg_name(model) -> str:
    return model.config.architecture


def check_lora_support(model, model_path: str, config: EngineConfig) -> None:
    """Before the tensor-parallel group connects: --max-loras on a model whose projections adapters reach."""
    name = cfg_name(model)
    if config.max_loras and model_path != MODULE_PATH:
        raise ValueError(f"{name} runs on the transformers path, which serves no LoRA adapters: start without "
                         "--max-loras")
    if config.max_loras and (getattr(model.config, "moe", None) is not None
                             or getattr(model.config, "mla", None) is not None):
        raise ValueError(f"max_loras: {name} has expert layers or latent attention, whose projections LoRA "
                         "adapters do not reach yet: start without --max-loras")


def check_model_options(model, model_path: str, config: EngineConfig, cache_dtype: torch.dtype, plan) -> None:
    """ValueError naming the option and what this model lacks for it."""
    name, spec, fp8 = cfg_name(model), config.speculative, cache_dtype == torch.float8_e4m3fn
    if getattr(model, "kv_latent", False) and fp8:
        raise ValueError(f"kv_cache_dtype: {name} caches latent attention entries, which have no FP8 scales yet: "
                         "use --kv-cache-dtype auto")
    if model_path != MODULE_PATH:
        if fp8:
            raise ValueError(f"kv_cache_dtype: {name} runs on the transformers path, whose attention reads no FP8 "
                             "KV cache scales: use --kv-cache-dtype auto")
        if spec is not None and spec.method == "eagle3":
            raise ValueError(f"speculative_config.method: eagle3 reads the target's hidden states, which {name} on "
                             "the transformers path does not keep")
    if spec is not None and spec.proposer_in_engine and plan.num_groups > 1:
        raise ValueError(f"speculative_config.method: {spec.method}'s KV cache follows one block table, and this "
                         f"model's sliding-window layers use {plan.num_groups} KV groups; use the ngram method or "
                         "no speculative decoding")
