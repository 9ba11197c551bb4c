"""The Llama family over a flattened token batch: Llama 2/3, Mistral, SmolLM2, TinyLlama, Qwen2 (QKV bias).

Selective batching: every token of every sequence goes through the linear layers as one [T, hidden]
matrix; only attention looks at per-sequence history, through the paged KV cache. Q/K/V and gate/up
projections are fused into one matrix each so a layer does four matrix products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.attention import AttentionMetadata, PagedAttention
from services.engine.rope import RotaryEmbedding


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling, max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, exactly as Hugging Face's LlamaRMSNorm.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights as plain tensors (no nn.Module machinery on the hot path)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype):
        self.config = config
        self.device, self.dtype = device, dtype
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        self.embed = weights["embed"]
        self.layers = weights["layers"]
        self.norm = weights["norm"]
        self.lm_head = weights["lm_head"]
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
                                    dtype, device)
        self.attn = PagedAttention(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sample_idx: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits for the rows in `sample_idx` only."""
        c = self.config
        eps = c.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        T = h.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, layer["input_norm"], eps)
            qkv = F.linear(x, layer["qkv"], layer.get("qkv_bias"))
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(T, c.num_heads, c.head_dim)
            k = k.view(T, c.num_kv_heads, c.head_dim)
            v = v.view(T, c.num_kv_heads, c.head_dim)
            q, k = self.rope(positions, q, k)
            o = self.attn(q, k, v, k_cache, v_cache, meta, self.scale)
            h = h + F.linear(o.reshape(T, self.q_size), layer["o"], layer.get("o_bias"))
            x = rms_norm(h, layer["post_norm"], eps)
            gate_up = F.linear(x, layer["gate_up"])
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"])
        h = rms_norm(h.index_select(0, sample_idx), self.norm, eps)
        return F.linear(h, self.lm_head).float()
