"""The shared decoder every family module composes: one forward over a flattened token batch.

Selective batching: every token of every sequence goes through the linear layers as one [T, hidden]
matrix; only attention looks at per-sequence history, through the paged KV cache of its layer's KV
group (services/engine/kv_groups.py: sliding-window layers keep their own, shorter block tables). Q/K/V
and gate/up projections are fused into one matrix each so a layer does four matrix products.

What differs between families is data in the `DecoderSpec`, applied where transformers applies it:
biases, q/k RMSNorm per head before RoPE (Qwen3, Gemma 3), Gemma's norms around attention and MLP and
its (1 + w) weights, the embedding scale, the attention scale, attention-logit and final-logit
soft-capping, each layer's window and RoPE, and the MLP activation.

Tensor parallel (a `RankGroup` and this rank's `TensorParallelShard`): the fused Q/K/V and gate/up
matrices hold this rank's heads and MLP rows (column-parallel), o_proj and down its columns
(row-parallel: one all-reduce each), the embedding and LM head its vocabulary rows (the embedding's
partial rows are summed; the LM head's logits for the sampled rows are gathered on rank 0, outside
the forward so a CUDA graph never captures a gather). Without a group no collective runs at all.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from services.engine.attention import AttentionMetadata, PagedAttention
from services.engine.kv_groups import plan_kv_groups
from services.engine.layers.activations import gated
from services.engine.layers.mla import MlaAttention
from services.engine.layers.moe import ExpertLayer
from services.engine.layers.norms import RMSNorm
from services.engine.layers.rotary import RotaryEmbedding
from services.engine.linear import make_linear_factory
from services.engine.models.spec import DecoderSpec, UnsupportedModelError
from services.engine.quant.projections import build_linear, embed_tokens

if TYPE_CHECKING:
    from services.engine.lora.batch import LoraBatch
    from services.engine.parallel_state import RankGroup
    from services.engine.tp_shard import TensorParallelShard


def weight_bytes(weights: dict) -> int:
    """Bytes of a model's weights as held (packed ones at their packed size; a tied LM head counted once)."""
    tensors = [weights["embed"], weights["norm"], *(t for layer in weights["layers"] for t in layer.values())]
    if weights["lm_head"] is not weights["embed"]:
        tensors.append(weights["lm_head"])
    return sum(t.nbytes for t in tensors)


class DecoderLayer:
    """One layer's weights, as callables, and its attention settings."""

    __slots__ = ("input_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm", "qkv", "o",
                 "gate_up", "down", "rope", "window", "kv_group", "mla", "moe", "sinks")

    def __init__(self, w: dict, spec: DecoderSpec, linear, rope: RotaryEmbedding, window: int | None, kv_group: int,
                 heads: int, triton_experts: bool = False):
        eps, offset, product = spec.rms_norm_eps, spec.norm_offset_one, spec.norm_float_product

        def norm(role: str) -> RMSNorm | None:
            return RMSNorm(w[role], eps, offset, product) if role in w else None

        self.input_norm, self.mlp_norm = norm("input_norm"), norm("mlp_norm")
        self.attn_out_norm, self.mlp_out_norm = norm("attn_out_norm"), norm("mlp_out_norm")
        self.q_norm, self.k_norm = norm("q_norm"), norm("k_norm")
        # Latent attention (DeepSeek) in place of the fused Q/K/V; an expert layer in place of the dense MLP.
        self.mla = MlaAttention(w, spec.mla, heads, linear) if "kv_a" in w else None
        self.qkv = self.o = None
        if self.mla is None:
            self.qkv, self.o = linear(w["qkv"], w.get("qkv_bias")), linear(w["o"], w.get("o_bias"))
        self.moe = ExpertLayer(w, spec.moe, linear, triton_experts) if "router" in w else None
        self.gate_up = self.down = None
        if self.moe is None:
            self.gate_up = linear(w["gate_up"], w.get("gate_up_bias"))
            self.down = linear(w["down"], w.get("down_bias"))
        self.sinks = w.get("sinks")  # gpt-oss: [heads] float32
        self.rope, self.window, self.kv_group = rope, window, kv_group


class DecoderModel:
    """Weights as plain tensors (no nn.Module machinery on the hot path). `kv_plan`: how the layers share
    the paged cache (services/engine/kv_groups.py), from each layer's effective window."""

    def __init__(self, spec: DecoderSpec, weights: dict, device: torch.device, dtype: torch.dtype,
                 attention_backend: str = "auto", group: RankGroup | None = None,
                 shard: TensorParallelShard | None = None, max_model_len: int | None = None):
        self.config = spec
        self.device, self.dtype = device, dtype
        c = spec
        assert (group is None) == (shard is None)
        self.group, self.shard = group, shard
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = c.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = c.num_kv_heads if shard is None else shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        self.scale = c.scale
        self.softcap = c.attn_logit_softcap
        self.max_model_len = min(max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        self.weight_bytes = weight_bytes(weights)
        plain = make_linear_factory(device, dtype)

        def linear(w, b=None):  # a plain tensor or a quantized projection (services/engine/quant)
            return build_linear(w, b, plain, dtype, device)

        self.embed = weights["embed"]
        # Gemma: transformers multiplies by sqrt(hidden) rounded to the model dtype.
        self.embed_scale = (None if c.embed_scale is None
                            else torch.tensor(c.embed_scale, dtype=dtype, device=device))
        # A window no served sequence outgrows is full attention.
        windows = [a.window if a.window is not None and a.window < self.max_model_len else None for a in c.layers]
        self.kv_plan = plan_kv_groups(windows)
        ropes: dict = {}
        self.attn = PagedAttention(attention_backend, device)
        # Expert layers: Triton's grouped kernel on CUDA (whatever the attention backend) and where attention runs
        # Triton on the CPU (the interpreter, in tests); the C++-backed CPU path otherwise.
        triton_experts = self.attn.name == "triton" or device.type != "cpu"
        if triton_experts and any(hasattr(w.get("experts_gate_up"), "gate_up") for w in weights["layers"]):
            raise UnsupportedModelError(f"{c.architecture}: quantized (MXFP4) experts run on the CPU path only; the "
                                        f"Triton grouped expert kernel (attention backend {self.attn.name!r} on "
                                        f"{device.type}) reads unquantized experts")
        self.layers = []
        for w, attn, window, g in zip(weights["layers"], c.layers, windows, self.kv_plan.layer_group, strict=True):
            if attn.rope not in ropes:
                ropes[attn.rope] = RotaryEmbedding(attn.rope, self.max_model_len, device)
            self.layers.append(DecoderLayer(w, c, linear, ropes[attn.rope], window, g, self.num_heads,
                                            triton_experts))
        if group is not None:  # row-parallel inputs are split: dynamic activation scales take the whole row's max
            for layer in self.layers:
                for row_parallel in (layer.o, layer.down, None if layer.mla is None else layer.mla.o):
                    if hasattr(row_parallel, "input_max_reduce"):
                        row_parallel.input_max_reduce = group.all_reduce_max
        self.ropes = list(ropes.values())
        self.norm = RMSNorm(weights["norm"], c.rms_norm_eps, c.norm_offset_one, c.norm_float_product)
        self.lm_head = linear(weights["lm_head"])
        self.final_softcap = c.final_logit_softcap
        # The plain output embedding: the sampler rescores half-precision near-ties of greedy rows with
        # it and the final hidden state, in float32 (soft-capping is monotonic: it cannot reorder them).
        # A rank holds only part of it, and a packed head has no plain form: no rescoring then.
        head = weights["lm_head"]
        self.head_weight = head if group is None and isinstance(head, torch.Tensor) else None
        # An FP8 KV cache's per-layer (k_scale, v_scale) (set by the model runner; None: the model's dtype),
        # and those the checkpoint carries (set by the loader).
        self.kv_scales: list[tuple[float, float]] | None = None
        self.checkpoint_kv_scales: list[tuple[float, float]] | None = None
        # EAGLE-3 (services/engine/spec_decode/eagle3.py): the residual stream entering these layers, for
        # every token of a forward, is kept in `aux_hidden` ([T, len * hidden]) for the draft head.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # Fused C++ elementwise kernels on the CPU in half precision; float32 keeps the op-for-op
        # Hugging Face arithmetic so its outputs stay bit-comparable in the parity tests. The fused norm is
        # Llama's order (weight in the model dtype), the fused activation SiLU.
        self.fused = None
        if device.type == "cpu" and dtype != torch.float32:
            from kernels.cpu import load

            self.fused = load()
        self.fused_norms = self.fused is not None and not c.norm_offset_one and not c.norm_float_product
        self.fused_silu = self.fused is not None and c.hidden_act in ("silu", "swish")
        # The fused RoPE rotates q and k inside the qkv buffer: not when they are normalised first.
        self.fused_rope = self.fused is not None and not c.qk_norm and c.mla is None
        # MLA caches one latent per token, read as both keys and values: one cache tensor per layer.
        self.kv_latent = c.mla is not None

    def _pre_norm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm):
        """(h + delta, norm(h + delta)); the fused kernel adds in place."""
        if self.fused_norms:
            return h, self.fused.add_rms_norm(h, delta, norm.weight, norm.eps)
        h = h if delta is None else h + delta
        return h, norm(h)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                sample_idx: torch.Tensor, lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits (in the model's dtype) and the final hidden state, for the rows in `sample_idx` only.
        `metas[g]`: the step's attention metadata for KV group g. `lora`: the step's adapter tokens, whose
        projections get their adapter's delta added."""
        c = self.config
        reduce = None if self.group is None else self.group.all_reduce
        h = embed_tokens(self.embed, input_ids, self.dtype) if reduce is None else self._embed_shard(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        last = len(self.layers) - 1
        # With a norm on the MLP's output the last layer's partial sums must be reduced before it.
        defer_last_reduce = reduce is not None and self.layers[-1].mlp_out_norm is None
        delta = None  # output of the previous sub-layer, not yet added to the residual stream h
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, x = self._pre_norm(h, delta, layer.input_norm)
            if i in self.aux_layers:
                aux[i] = h.clone()  # h is updated in place by the fused kernels
            if layer.mla is not None:
                # The one latent cache tensor is read as keys and values.
                attend = functools.partial(self._attend_latent, cache=k_cache, meta=metas[layer.kv_group],
                                           kv_scales=None if self.kv_scales is None else self.kv_scales[i],
                                           window=layer.window)
                delta = layer.mla(x, positions, layer.rope, attend)
            else:
                delta = self._attention(i, layer, x, positions, metas, k_cache, v_cache, lora)
            if reduce is not None:
                reduce(delta)
            if layer.attn_out_norm is not None:
                delta = layer.attn_out_norm(delta)
            h, x = self._pre_norm(h, delta, layer.mlp_norm)
            if layer.moe is not None:
                delta = layer.moe(x)
            else:
                gate_up = layer.gate_up(x)
                if lora is not None:
                    lora.apply(i, "gate_up", x, gate_up)
                act = self.fused.silu_mul(gate_up) if self.fused_silu else gated(c.hidden_act, gate_up)
                delta = layer.down(act)
                if lora is not None:
                    lora.apply(i, "down", act, delta)
            if reduce is not None and not (i == last and defer_last_reduce):
                reduce(delta)
            if layer.mlp_out_norm is not None:
                delta = layer.mlp_out_norm(delta)
        if aux:
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        delta = delta.index_select(0, sample_idx)
        if defer_last_reduce:  # the last layer's MLP feeds only the sampled rows: reduce just those
            reduce(delta)
        h = h.index_select(0, sample_idx) + delta
        hidden = self.norm(h)
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits, hidden

    def _attend_latent(self, q, kv, *, cache, meta, kv_scales, window):
        return self.attn(q, kv, kv, cache, cache, meta, self.scale, kv_scales, window=window, softcap=self.softcap)

    def _attention(self, i: int, layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor, metas, k_cache,
                   v_cache, lora) -> torch.Tensor:
        """Q/K/V, RoPE, paged attention and o_proj of layer i (before the tensor-parallel reduce)."""
        T, D = x.shape[0], self.config.head_dim
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = layer.qkv(x)
        if lora is not None:
            lora.apply(i, "qkv", x, qkv)
        if self.fused_rope:
            rope = layer.rope
            self.fused.rope_inplace(qkv, positions, rope.cos, rope.sin, heads + kv_heads, D, rope.rotary_dim)
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q, k = q.view(T, heads, D), k.view(T, kv_heads, D)
        else:
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q, k = q.view(T, heads, D), k.view(T, kv_heads, D)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = layer.rope(positions, q, k)
        v = v.view(T, kv_heads, D)
        options = {} if layer.sinks is None else {"sinks": layer.sinks}
        o = self.attn(q, k, v, k_cache, v_cache, metas[layer.kv_group], self.scale,
                      None if self.kv_scales is None else self.kv_scales[i], window=layer.window,
                      softcap=self.softcap, **options)
        o = o.reshape(T, self.q_size)
        delta = layer.o(o)
        if lora is not None:
            lora.apply(i, "o", o, delta)
        return delta

    def take_expert_tokens(self) -> list[int]:
        """Tokens routed to each expert since the last call, summed over the expert layers (then zeroed)."""
        counters = [layer.moe.expert_tokens for layer in self.layers if layer.moe is not None]
        total = torch.stack(counters).sum(0).tolist()
        for c in counters:
            c.zero_()
        return total

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
