"""Gemma 2 and Gemma 3 (text): pre- and post-norms around attention and MLP, RMSNorm multiplying by
(1 + w) in float32, embeddings scaled by sqrt(hidden) in the model dtype, the attention scale from
`query_pre_attn_scalar`, GELU-tanh, sliding and global layers from `layer_types`. Gemma 2 caps
attention logits and final logits (cap * tanh(x / cap)); Gemma 3 normalises each query and key head and
gives local and global layers their own RoPE (`rope_parameters` per layer type)."""

from __future__ import annotations

from services.engine.models.family import SIZES, Family, activation, layer_windows, sizes
from services.engine.models.hf_config import FieldAudit
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import GEMMA_NORMS, CheckpointLayout, DecoderSpec, LayerAttention

_GEMMA_FIELDS = SIZES | {"hidden_activation", "head_dim", "attention_bias", "query_pre_attn_scalar",
                         "sliding_window", "layer_types", "final_logit_softcapping"}


def _common(cfg, architecture: str) -> dict:
    base = sizes(cfg)
    bias = bool(cfg.attention_bias)
    return dict(architecture=architecture, **base, hidden_act=activation(cfg, "hidden_activation"),
                qkv_bias=bias, o_bias=bias, attention_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                final_logit_softcap=cfg.final_logit_softcapping, norm_offset_one=True,
                embed_scale=float(cfg.hidden_size) ** 0.5, layout=CheckpointLayout(norms=GEMMA_NORMS))


def build_gemma2(cfg, architecture: str) -> DecoderSpec:
    common = _common(cfg, architecture)
    rope = rope_spec(cfg.rope_parameters, common["head_dim"], cfg.max_position_embeddings)
    return DecoderSpec(**common, attn_logit_softcap=cfg.attn_logit_softcapping,
                       layers=tuple(LayerAttention(w, rope) for w in layer_windows(cfg, architecture)))


def build_gemma3(cfg, architecture: str) -> DecoderSpec:
    common = _common(cfg, architecture)
    ropes = {kind: rope_spec(cfg.rope_parameters[kind], common["head_dim"], cfg.max_position_embeddings,
                             f"rope_parameters.{kind}") for kind in set(cfg.layer_types)}
    layers = tuple(LayerAttention(w, ropes[kind])
                   for w, kind in zip(layer_windows(cfg, architecture), cfg.layer_types, strict=True))
    return DecoderSpec(**common, qk_norm=True, layers=layers)


_NOT_BIDIRECTIONAL = {"use_bidirectional_attention": (None, False)}
FAMILIES = (
    Family("Gemma2ForCausalLM", "gemma2", "Gemma2Config",
           FieldAudit(_GEMMA_FIELDS | {"attn_logit_softcapping"}, only=_NOT_BIDIRECTIONAL), build_gemma2),
    # transformers' Gemma 3 stores attn_logit_softcapping but never applies it: a value there has no one
    # meaning, so it is refused rather than guessed.
    Family("Gemma3ForCausalLM", "gemma3_text", "Gemma3TextConfig",
           FieldAudit(_GEMMA_FIELDS, only={**_NOT_BIDIRECTIONAL, "attn_logit_softcapping": (None,)}), build_gemma3),
)
