"""The Llama family over a flattened token batch: Llama 2/3, Mistral, SmolLM2, TinyLlama, Qwen2 (QKV bias).

Selective batching: every token of every sequence goes through the linear layers as one [T, hidden]
matrix; only attention looks at per-sequence history, through the paged KV cache. Q/K/V and gate/up
projections are fused into one matrix each so a layer does four matrix products.

Tensor parallel (a `RankGroup` and this rank's `TensorParallelShard`): the fused Q/K/V and gate/up
matrices hold this rank's heads and MLP rows (column-parallel), o_proj and down its columns
(row-parallel: one all-reduce each), the embedding and LM head its vocabulary rows (the embedding's
partial rows are summed; the LM head's logits for the sampled rows are gathered on rank 0, outside
the forward so a CUDA graph never captures a gather). Without a group no collective runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.engine.attention import AttentionMetadata, PagedAttention
from services.engine.linear import make_linear_factory
from services.engine.quant.projections import build_linear, embed_tokens
from services.engine.rope import RotaryEmbedding

if TYPE_CHECKING:
    from services.engine.lora.batch import LoraBatch
    from services.engine.parallel_state import RankGroup
    from services.engine.tp_shard import TensorParallelShard


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


def weight_bytes(weights: dict) -> int:
    """Bytes of a model's weights as held (packed ones at their packed size; a tied LM head counted once)."""
    tensors = [weights["embed"], weights["norm"], *(t for layer in weights["layers"] for t in layer.values())]
    if weights["lm_head"] is not weights["embed"]:
        tensors.append(weights["lm_head"])
    return sum(t.nbytes for t in tensors)


class LlamaModel:
    """Weights as plain tensors (no nn.Module machinery on the hot path)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto", group: RankGroup | None = None,
                 shard: TensorParallelShard | None = None):
        self.config = config
        self.device, self.dtype = device, dtype
        c = config
        assert (group is None) == (shard is None)
        self.group, self.shard = group, shard
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = c.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = c.num_kv_heads if shard is None else shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        self.weight_bytes = weight_bytes(weights)
        plain = make_linear_factory(device, dtype)

        def linear(w, b=None):  # a plain tensor or a quantized projection (services/engine/quant)
            return build_linear(w, b, plain, dtype, device)

        self.embed = weights["embed"]
        self.layers = [{
            "input_norm": w["input_norm"], "post_norm": w["post_norm"],
            "qkv": linear(w["qkv"], w.get("qkv_bias")), "o": linear(w["o"], w.get("o_bias")),
            "gate_up": linear(w["gate_up"]), "down": linear(w["down"]),
        } for w in weights["layers"]]
        self.norm = weights["norm"]
        self.lm_head = linear(weights["lm_head"])
        # The plain output embedding: the sampler rescores half-precision near-ties of greedy rows with
        # it and the final hidden state, in float32. A rank holds only part of it, and a packed head has
        # no plain form: no rescoring then.
        head = weights["lm_head"]
        self.head_weight = head if group is None and isinstance(head, torch.Tensor) else None
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
                                    dtype, device)
        self.attn = PagedAttention(attention_backend, device)
        # An FP8 KV cache's per-layer (k_scale, v_scale) (set by the model runner; None: the model's dtype),
        # and those the checkpoint carries (set by the loader).
        self.kv_scales: list[tuple[float, float]] | None = None
        self.checkpoint_kv_scales: list[tuple[float, float]] | None = None
        # Fused C++ elementwise kernels on the CPU in half precision; float32 keeps the op-for-op
        # Hugging Face arithmetic so its outputs stay bit-comparable in the parity tests.
        self.fused = None
        if device.type == "cpu" and dtype != torch.float32:
            from kernels.cpu import load

            self.fused = load()
        # EAGLE-3 (services/engine/spec_decode/eagle3.py): the residual stream entering these layers, for
        # every token of a forward, is kept in `aux_hidden` ([T, len * hidden]) for the draft head.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                sample_idx: torch.Tensor, lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits (in the model's dtype) and the final hidden state, for the rows in `sample_idx` only.
        `lora`: the step's adapter tokens, whose projections get their adapter's delta added."""
        c = self.config
        eps = c.rms_norm_eps
        fused = self.fused
        reduce = None if self.group is None else self.group.all_reduce
        heads, kv_heads = self.num_heads, self.num_kv_heads
        h = embed_tokens(self.embed, input_ids, self.dtype) if reduce is None else self._embed_shard(input_ids)
        T = h.shape[0]
        last = len(self.layers) - 1
        delta = None  # output of the previous sub-layer, not yet added to the residual stream h
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if fused is not None:
                x = fused.add_rms_norm(h, delta, layer["input_norm"], eps)  # also h += delta, in place
            else:
                h = h if delta is None else h + delta
                x = rms_norm(h, layer["input_norm"], eps)
            if i in self.aux_layers:
                aux[i] = h.clone()  # h is updated in place by the fused kernels
            qkv = layer["qkv"](x)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            if fused is not None:
                fused.rope_inplace(qkv, positions, self.rope.cos, self.rope.sin, heads + kv_heads, c.head_dim)
                q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
                q = q.view(T, heads, c.head_dim)
                k = k.view(T, kv_heads, c.head_dim)
            else:
                q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
                q, k = self.rope(positions, q.view(T, heads, c.head_dim), k.view(T, kv_heads, c.head_dim))
            v = v.view(T, kv_heads, c.head_dim)
            o = self.attn(q, k, v, k_cache, v_cache, meta, self.scale,
                          None if self.kv_scales is None else self.kv_scales[i])
            o = o.reshape(T, self.q_size)
            delta = layer["o"](o)
            if lora is not None:
                lora.apply(i, "o", o, delta)
            if reduce is not None:
                reduce(delta)
            if fused is not None:
                x = fused.add_rms_norm(h, delta, layer["post_norm"], eps)
            else:
                h = h + delta
                x = rms_norm(h, layer["post_norm"], eps)
            gate_up = layer["gate_up"](x)
            if lora is not None:
                lora.apply(i, "gate_up", x, gate_up)
            if fused is not None:
                act = fused.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = layer["down"](act)
            if lora is not None:
                lora.apply(i, "down", act, delta)
            if reduce is not None and i != last:
                reduce(delta)
        if aux:
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        delta = delta.index_select(0, sample_idx)
        if reduce is not None:  # the last layer's MLP feeds only the sampled rows: reduce just those
            reduce(delta)
        h = h.index_select(0, sample_idx) + delta
        hidden = rms_norm(h, self.norm, eps)
        return self.lm_head(hidden), hidden

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: this rank's rows where it holds the token, zeros elsewhere, summed."""
        lo, hi = self.shard.vocab_rows
        outside = (input_ids < lo) | (input_ids >= hi)
        h = embed_tokens(self.embed, (input_ids - lo).masked_fill_(outside, 0), self.dtype)
        h.masked_fill_(outside.unsqueeze(1), 0)
        return self.group.all_reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """The sampled rows' logits over the whole vocabulary on rank 0 (None on the other ranks), from
        every rank's [rows, vocab_shard] piece."""
        pieces = self.group.gather_to_first(local.contiguous())
        if pieces is None:
            return None
        logits = torch.cat(pieces, dim=1)
        vocab = self.config.vocab_size
        return logits if logits.shape[1] == vocab else logits[:, :vocab].contiguous()
