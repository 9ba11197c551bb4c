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
from services.engine.linear import make_linear_factory
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
                 dtype: torch.dtype, attention_backend: str = "auto"):
        self.config = config
        self.device, self.dtype = device, dtype
        c = config
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        linear = make_linear_factory(device, dtype)
        self.embed = weights["embed"]
        self.layers = [{
            "input_norm": w["input_norm"], "post_norm": w["post_norm"],
            "qkv": linear(w["qkv"], w.get("qkv_bias")), "o": linear(w["o"], w.get("o_bias")),
            "gate_up": linear(w["gate_up"]), "down": linear(w["down"]),
        } for w in weights["layers"]]
        self.norm = weights["norm"]
        self.lm_head = linear(weights["lm_head"])
        # The plain output embedding: the sampler rescores half-precision near-ties of greedy rows with
        # it and the final hidden state, in float32.
        self.head_weight = weights["lm_head"]
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
                                    dtype, device)
        self.attn = PagedAttention(attention_backend, device)
        # Fused C++ elementwise kernels on the CPU in half precision; float32 keeps the op-for-op
        # Hugging Face arithmetic so its outputs stay bit-comparable in the parity tests.
        self.fused = None
        if device.type == "cpu" and dtype != torch.float32:
            from kernels.cpu import load

            self.fused = load()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                sample_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits (in the model's dtype) and the final hidden state, for the rows in `sample_idx` only."""
        c = self.config
        eps = c.rms_norm_eps
        fused = self.fused
        h = F.embedding(input_ids, self.embed)
        T = h.shape[0]
        delta = None  # output of the previous sub-layer, not yet added to the residual stream h
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if fused is not None:
                x = fused.add_rms_norm(h, delta, layer["input_norm"], eps)  # also h += delta, in place
            else:
                h = h if delta is None else h + delta
                x = rms_norm(h, layer["input_norm"], eps)
            qkv = layer["qkv"](x)
            if fused is not None:
                fused.rope_inplace(qkv, positions, self.rope.cos, self.rope.sin, c.num_heads + c.num_kv_heads,
                                   c.head_dim)
                q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
                q = q.view(T, c.num_heads, c.head_dim)
                k = k.view(T, c.num_kv_heads, c.head_dim)
            else:
                q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
                q, k = self.rope(positions, q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim))
            v = v.view(T, c.num_kv_heads, c.head_dim)
            o = self.attn(q, k, v, k_cache, v_cache, meta, self.scale)
            delta = layer["o"](o.reshape(T, self.q_size))
            if fused is not None:
                x = fused.add_rms_norm(h, delta, layer["post_norm"], eps)
                act = fused.silu_mul(layer["gate_up"](x))
            else:
                h = h + delta
                x = rms_norm(h, layer["post_norm"], eps)
                gate, up = layer["gate_up"](x).chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = layer["down"](act)
        h = h.index_select(0, sample_idx) + delta.index_select(0, sample_idx)
        hidden = rms_norm(h, self.norm, eps)
        return self.lm_head(hidden), hidden
