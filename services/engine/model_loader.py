"""Loads Llama-family weights from a Hugging Face safetensors directory into fused, device-ready tensors,
or draws random ones in a model's real shapes (benchmarks on a machine with no model to download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.llama import LlamaConfig, LlamaModel

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def read_config(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = set(cfg.get("architectures") or ["LlamaForCausalLM"])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {sorted(archs)}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return cfg


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                tensors[name.removeprefix("model.")] = handle.get_tensor(name)
    return tensors


def load_llama(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               attention_backend: str = "auto") -> tuple[LlamaModel, dict]:
    model_dir = Path(model_dir)
    hf_cfg = read_config(model_dir)
    config = LlamaConfig.from_hf(hf_cfg)
    t = _read_tensors(model_dir)

    def take(name: str) -> torch.Tensor:
        if name not in t:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        return t.pop(name)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layer = {
            "input_norm": put(take(p + "input_layernorm.weight")),
            "post_norm": put(take(p + "post_attention_layernorm.weight")),
            "qkv": put(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])),
            "o": put(take(p + "self_attn.o_proj.weight")),
            "gate_up": put(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
            "down": put(take(p + "mlp.down_proj.weight")),
        }
        if p + "self_attn.q_proj.bias" in t:
            layer["qkv_bias"] = put(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
        if p + "self_attn.o_proj.bias" in t:
            layer["o_bias"] = put(take(p + "self_attn.o_proj.bias"))
        layers.append(layer)
    embed = put(take("embed_tokens.weight"))
    if "lm_head.weight" in t and not config.tie_word_embeddings:
        lm_head = put(take("lm_head.weight"))
    else:
        lm_head = embed
    weights = {"embed": embed, "layers": layers, "norm": put(take("norm.weight")), "lm_head": lm_head}
    return LlamaModel(config, weights, device, dtype, attention_backend), hf_cfg


def random_llama(hf_cfg: dict, dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
                 seed: int = 0) -> LlamaModel:
    """A Llama of `hf_cfg`'s shapes with random weights drawn on the device (no download, no disk)."""
    c = LlamaConfig.from_hf(hf_cfg)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(std)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [{"input_norm": ones(c.hidden_size), "post_norm": ones(c.hidden_size),
               "qkv": rand(qkv_rows, c.hidden_size), "o": rand(c.hidden_size, c.num_heads * c.head_dim),
               "gate_up": rand(2 * c.intermediate_size, c.hidden_size),
               "down": rand(c.hidden_size, c.intermediate_size)} for _ in range(c.num_layers)]
    embed = rand(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else rand(c.vocab_size, c.hidden_size)
    weights = {"embed": embed, "layers": layers, "norm": ones(c.hidden_size), "lm_head": lm_head}
    return LlamaModel(c, weights, device, dtype, attention_backend)
