"""The mixture-of-experts families whose attention is the Llama shape's: Mixtral (`block_sparse_moe`,
per-expert w1/w3/w2, softmax over every expert then the top k renormalised, one sliding window for every
layer) and Qwen3-MoE (q/k norms, softmax then top k renormalised only with `norm_topk_prob`, dense MLPs on
`mlp_only_layers` and off the `decoder_sparse_step` layers). The expert layer is layers/moe.py's."""

from __future__ import annotations

from services.engine.layers.moe import MoeSpec
from services.engine.models.family import SIZES, Family, activation, sizes, uniform_window
from services.engine.models.hf_config import COMMON_NO_MATH, FieldAudit
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import DecoderSpec, ExpertLayout, LayerAttention, UnsupportedModelError

# Training-only fields of the MoE configs: the auxiliary load-balancing loss and the router's logits output.
MOE_NO_MATH = COMMON_NO_MATH | {"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"}


def expert_activation_of(cfg, architecture: str) -> str:
    """The experts' activation: SiLU-gated, as every MoE family here ships (anything else refused)."""
    name = activation(cfg)
    if name not in ("silu", "swish"):
        raise UnsupportedModelError(f"{architecture}: config field hidden_act={name!r} is not supported for the "
                                    "expert layers (silu)")
    return "silu"


def build_mixtral(cfg, architecture: str) -> DecoderSpec:
    base = sizes(cfg)
    rope = rope_spec(cfg.rope_parameters, base["head_dim"], cfg.max_position_embeddings)
    moe = MoeSpec(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                  intermediate_size=cfg.intermediate_size, routing="softmax_topk", norm_topk_prob=True,
                  activation=expert_activation_of(cfg, architecture))
    window = uniform_window(cfg, architecture)
    return DecoderSpec(architecture=architecture, **base, hidden_act="silu",
                       layers=tuple(LayerAttention(window, rope) for _ in range(cfg.num_hidden_layers)),
                       moe=moe, moe_layers=frozenset(range(cfg.num_hidden_layers)),
                       expert_layout=ExpertLayout(block="block_sparse_moe", expert_names=("w1", "w3", "w2")))


def qwen3_moe_layers(cfg) -> frozenset[int]:
    """transformers' Qwen3MoeDecoderLayer rule for which layers have experts."""
    step = cfg.decoder_sparse_step
    if cfg.num_experts > 0 and (not isinstance(step, int) or step < 1):
        raise UnsupportedModelError(f"config field decoder_sparse_step={step!r} is not a positive step")
    return frozenset(i for i in range(cfg.num_hidden_layers)
                     if i not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (i + 1) % step == 0)


def build_qwen3_moe(cfg, architecture: str) -> DecoderSpec:
    base = sizes(cfg)
    rope = rope_spec(cfg.rope_parameters, base["head_dim"], cfg.max_position_embeddings)
    bias = bool(cfg.attention_bias)
    layers = qwen3_moe_layers(cfg)
    moe = MoeSpec(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                  intermediate_size=cfg.moe_intermediate_size, routing="softmax_topk",
                  norm_topk_prob=bool(cfg.norm_topk_prob), activation=expert_activation_of(cfg, architecture))
    window = uniform_window(cfg, architecture)  # None unless use_sliding_window (transformers' post-init)
    return DecoderSpec(architecture=architecture, **base, hidden_act="silu", qkv_bias=bias, o_bias=bias, qk_norm=True,
                       layers=tuple(LayerAttention(window, rope) for _ in range(cfg.num_hidden_layers)),
                       moe=moe if layers else None, moe_layers=layers,
                       expert_layout=ExpertLayout() if layers else None)


FAMILIES = (
    Family("MixtralForCausalLM", "mixtral", "MixtralConfig",
           FieldAudit(SIZES | {"hidden_act", "head_dim", "sliding_window", "num_local_experts", "num_experts_per_tok"},
                      no_math=MOE_NO_MATH), build_mixtral),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeConfig",
           FieldAudit(SIZES | {"hidden_act", "head_dim", "attention_bias", "sliding_window", "use_sliding_window",
                               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                               "mlp_only_layers", "decoder_sparse_step"}, no_math=MOE_NO_MATH), build_qwen3_moe),
)
