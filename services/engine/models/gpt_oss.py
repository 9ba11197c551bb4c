"""gpt-oss: attention with biases and a learned sink logit per head (in the softmax denominator, every
backend), alternating sliding-window and full layers from `layer_types`, YaRN RoPE; an expert layer with
a biased router (top k of the logits, softmax over those k), fused gate_up experts with biases and the
clamped SwiGLU `(clamp(up) + 1) * gate * sigmoid(alpha * gate)`. RMSNorm multiplies in float32."""

from __future__ import annotations

from services.engine.layers.moe import MoeSpec
from services.engine.models.family import SIZES, Family, layer_windows, sizes
from services.engine.models.hf_config import FieldAudit
from services.engine.models.moe_families import MOE_NO_MATH, expert_activation_of
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import DecoderSpec, ExpertLayout, LayerAttention


def build_gpt_oss(cfg, architecture: str) -> DecoderSpec:
    base = sizes(cfg)
    rope = rope_spec(cfg.rope_parameters, base["head_dim"], cfg.max_position_embeddings)
    expert_activation_of(cfg, architecture)  # hidden_act names the gate's SiLU-like base; refuse anything else
    moe = MoeSpec(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                  intermediate_size=cfg.intermediate_size, routing="topk_softmax", router_bias=True,
                  activation="gpt_oss_swiglu", expert_bias=True, swiglu_alpha=float(cfg.swiglu_alpha),
                  swiglu_limit=float(cfg.swiglu_limit))
    bias = bool(cfg.attention_bias)
    return DecoderSpec(architecture=architecture, **base, hidden_act="silu", qkv_bias=bias, o_bias=bias,
                       layers=tuple(LayerAttention(w, rope) for w in layer_windows(cfg, architecture)),
                       norm_float_product=True, attention_sinks=True, moe=moe,
                       moe_layers=frozenset(range(cfg.num_hidden_layers)),
                       expert_layout=ExpertLayout(router="router", expert_names=None))


FAMILIES = (
    Family("GptOssForCausalLM", "gpt_oss", "GptOssConfig",
           FieldAudit(SIZES | {"hidden_act", "head_dim", "attention_bias", "layer_types", "sliding_window",
                               "num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"},
                      no_math=MOE_NO_MATH), build_gpt_oss),
)
