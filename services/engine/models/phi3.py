"""Phi-3 and Phi-4-mini: the Llama shape with fused `qkv_proj` and `gate_up_proj` in the checkpoint,
partial rotary embeddings (`partial_rotary_factor`), LongRoPE scaling (see layers/rotary.py for which
factor set is used), and one `sliding_window` for every layer."""

from __future__ import annotations

from services.engine.models.family import SIZES, Family, activation, sizes, uniform_window
from services.engine.models.hf_config import FieldAudit
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import CheckpointLayout, DecoderSpec, LayerAttention


def build_phi3(cfg, architecture: str) -> DecoderSpec:
    base = sizes(cfg)
    rope = rope_spec(cfg.rope_parameters, base["head_dim"], cfg.max_position_embeddings)
    window = uniform_window(cfg, architecture)
    return DecoderSpec(architecture=architecture, **base, hidden_act=activation(cfg),
                       layout=CheckpointLayout(fused_qkv=True, fused_gate_up=True),
                       layers=tuple(LayerAttention(window, rope) for _ in range(cfg.num_hidden_layers)))


FAMILIES = (
    # original_max_position_embeddings is read through rope_parameters (transformers copies it there).
    Family("Phi3ForCausalLM", "phi3", "Phi3Config",
           FieldAudit(SIZES | {"hidden_act", "sliding_window", "original_max_position_embeddings"}), build_phi3),
)
