"""The Llama family: Llama 2/3 (SmolLM2, TinyLlama), Mistral (one sliding window for every layer) and
Qwen2 (Q/K/V biases; sliding windows on the layers `layer_types` names, from `use_sliding_window` and
`max_window_layers`). Pre-norm decoder, RMSNorm in Llama order, gated MLP."""

from __future__ import annotations

from services.engine.models.family import SIZES, Family, activation, layer_windows, sizes, uniform_window
from services.engine.models.hf_config import FieldAudit
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import DecoderSpec, LayerAttention


def _spec(cfg, architecture: str, windows: list[int | None], **extra) -> DecoderSpec:
    base = sizes(cfg)
    rope = rope_spec(cfg.rope_parameters, base["head_dim"], cfg.max_position_embeddings)
    return DecoderSpec(architecture=architecture, layers=tuple(LayerAttention(w, rope) for w in windows),
                       hidden_act=activation(cfg), **base, **extra)


def build_llama(cfg, architecture: str) -> DecoderSpec:
    bias = bool(cfg.attention_bias)
    return _spec(cfg, architecture, [None] * cfg.num_hidden_layers, qkv_bias=bias, o_bias=bias,
                 mlp_bias=bool(cfg.mlp_bias))


def build_mistral(cfg, architecture: str) -> DecoderSpec:
    return _spec(cfg, architecture, [uniform_window(cfg, architecture)] * cfg.num_hidden_layers)


def build_qwen2(cfg, architecture: str) -> DecoderSpec:
    # transformers' Qwen2 attention: biases on q/k/v, none on o_proj.
    return _spec(cfg, architecture, layer_windows(cfg, architecture), qkv_bias=True)


FAMILIES = (
    Family("LlamaForCausalLM", "llama", "LlamaConfig",
           FieldAudit(SIZES | {"hidden_act", "attention_bias", "mlp_bias", "head_dim"}), build_llama),
    Family("MistralForCausalLM", "mistral", "MistralConfig",
           FieldAudit(SIZES | {"hidden_act", "head_dim", "sliding_window"}), build_mistral),
    Family("Qwen2ForCausalLM", "qwen2", "Qwen2Config",
           FieldAudit(SIZES | {"hidden_act", "layer_types", "sliding_window", "use_sliding_window",
                               "max_window_layers"}), build_qwen2),
)
