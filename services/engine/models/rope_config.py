"""A RopeSpec from a transformers config's `rope_parameters` (one dict, or one per layer type as Gemma 3
has), refusing by name a RoPE type or a parameter the rotary layer does not implement."""

from __future__ import annotations

from services.engine.layers.rotary import ROPE_TYPES, RopeSpec
from services.engine.models.spec import UnsupportedModelError

_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# The parameters each type reads; any other key could change the frequencies and is refused.
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "longrope": {"short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"},
}


def rope_spec(params: dict | None, head_dim: int, max_position_embeddings: int, where: str = "rope_parameters"
              ) -> RopeSpec:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"config field {where}.rope_type={kind!r} is not supported (supported: "
                                    f"{', '.join(ROPE_TYPES)})")
    unknown = sorted(set(params) - _COMMON - _KEYS[kind])
    if unknown:
        raise UnsupportedModelError(f"config field {where}.{unknown[0]} is not supported with rope_type {kind!r}")
    partial = float(params.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(f"config field {where}.partial_rotary_factor={partial} gives an odd or empty "
                                    f"rotary dimension ({rotary_dim} of {head_dim})")
    for key in ("short_factor", "long_factor"):
        if kind == "longrope" and len(params.get(key) or ()) != rotary_dim // 2:
            raise UnsupportedModelError(f"config field {where}.{key} must have {rotary_dim // 2} entries")
    keep = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items() if k in _KEYS[kind]}
    theta = params.get("rope_theta")
    return RopeSpec(theta=float(10000.0 if theta is None else theta), rotary_dim=rotary_dim, rope_type=kind,
                    params=tuple(sorted(keep.items())), max_position_embeddings=max_position_embeddings)
