"""DeepSeek-V3 (and the models built on its architecture, Kimi K2 among them): multi-head latent
attention (layers/mla.py) and, from layer `first_k_dense_replace` on, an expert layer with sigmoid routing
(`e_score_correction_bias`, group-limited top-k over `n_group` / `topk_group`, `routed_scaling_factor`)
and shared experts. The multi-token-prediction layers a checkpoint may carry (`num_nextn_predict_layers`)
are not read: they only draft tokens, and the load log says so."""

from __future__ import annotations

import logging

from services.engine.layers.mla import MlaSpec
from services.engine.layers.moe import MoeSpec
from services.engine.models.family import SIZES, Family, sizes
from services.engine.models.hf_config import FieldAudit
from services.engine.models.moe_families import MOE_NO_MATH, expert_activation_of
from services.engine.models.rope_config import rope_spec
from services.engine.models.spec import DecoderSpec, ExpertLayout, LayerAttention, UnsupportedModelError

log = logging.getLogger(__name__)


def mla_scale(cfg, qk_head_dim: int) -> float:
    """transformers' `yarn_apply_mscale`: a scaled RoPE with `mscale_all_dim` multiplies the softmax scale by
    mscale(factor)^2."""
    import math

    scale = qk_head_dim ** -0.5
    params = cfg.rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def build_deepseek_v3(cfg, architecture: str) -> DecoderSpec:
    mla = MlaSpec(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                  qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                  rope_interleave=bool(cfg.rope_interleave))
    base = sizes(cfg)
    # The cache holds one latent "KV head" per token; queries keep their heads.
    base.update(num_kv_heads=1, head_dim=mla.cache_dim)
    rope = rope_spec(cfg.rope_parameters, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    n_layers, dense = cfg.num_hidden_layers, cfg.first_k_dense_replace
    if not isinstance(dense, int) or dense < 0:
        raise UnsupportedModelError(f"{architecture}: config field first_k_dense_replace={dense!r}")
    shared = cfg.n_shared_experts or 0
    moe = MoeSpec(num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                  intermediate_size=cfg.moe_intermediate_size, routing="sigmoid_group",
                  norm_topk_prob=bool(cfg.norm_topk_prob), n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1,
                  routed_scaling_factor=float(cfg.routed_scaling_factor), score_correction_bias=True,
                  router_float32=True, activation=expert_activation_of(cfg, architecture),
                  shared_intermediate_size=cfg.moe_intermediate_size * shared)
    mtp = getattr(cfg, "num_mtp_layers", 0) or 0
    if mtp:
        log.info("%s: the checkpoint's %d multi-token-prediction layer(s) are not read (they only draft tokens)",
                 architecture, mtp)
    layers = frozenset(range(dense, n_layers))
    return DecoderSpec(architecture=architecture, **base, hidden_act="silu",
                       attention_scale=mla_scale(cfg, mla.qk_head_dim),
                       layers=tuple(LayerAttention(None, rope) for _ in range(n_layers)),
                       moe=moe if layers else None, moe_layers=layers,
                       expert_layout=ExpertLayout(shared="shared_experts" if shared else None) if layers else None,
                       mla=mla)


FAMILIES = (
    Family("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3Config",
           FieldAudit(SIZES | {"hidden_act", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                               "qk_rope_head_dim", "v_head_dim", "rope_interleave", "moe_intermediate_size", "n_group",
                               "topk_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
                               "num_experts_per_tok", "routed_scaling_factor", "head_dim"},
                      # The MTP layers only draft tokens (logged above); biases on the latent projections are
                      # not implemented.
                      no_math=MOE_NO_MATH | {"num_mtp_layers"}, only={"attention_bias": (False, None)}),
           build_deepseek_v3),
)
