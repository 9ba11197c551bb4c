"""Qwen3 (dense): the Llama shape with an RMSNorm over each query and key head before RoPE, a
`head_dim` independent of the hidden size, optional attention biases, and sliding windows on the
layers `layer_types` names."""

from __future__ import annotations

from services.engine.models.family import SIZES, Family, activation, layer_windows, sizes
from services.engine.models.hf_config import FieldAudit
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import DecoderSpec, LayerAttention


def build_qwen3(cfg, architecture: str) -> DecoderSpec:
    base = sizes(cfg)
    rope = rope_spec(cfg.rope_parameters, base["head_dim"], cfg.max_position_embeddings)
    bias = bool(cfg.attention_bias)
    return DecoderSpec(architecture=architecture, **base, hidden_act=activation(cfg), qkv_bias=bias, o_bias=bias,
                       qk_norm=True,
                       layers=tuple(LayerAttention(w, rope) for w in layer_windows(cfg, architecture)))


FAMILIES = (
    Family("Qwen3ForCausalLM", "qwen3", "Qwen3Config",
           FieldAudit(SIZES | {"hidden_act", "attention_bias", "head_dim", "layer_types", "sliding_window",
                               "use_sliding_window", "max_window_layers"}), build_qwen3),
)
