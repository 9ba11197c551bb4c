"""Rotary position embeddings: the frequency rules of every RoPE type the model families use, partial
rotation, and the cos/sin tables the forward indexes by absolute position.

`RopeSpec` is what a family reads from its config (`models/rope_config.py`); `rope_inv_freq` turns it
into inverse frequencies and the attention factor that multiplies cos and sin, with the same float32
arithmetic as transformers' `ROPE_INIT_FUNCTIONS`, so float32 outputs stay bit-comparable with it.

Types: `default`, `linear`, `dynamic`, `llama3`, `yarn`, `longrope`. Two of them depend, in
transformers, on the length of the sequence a forward call sees, which a batching server cannot
reproduce per call without giving the same prefix two different caches:
- `dynamic` (NTK): transformers rescales only past `max_position_embeddings`; pagedserve never serves
  past it (max_model_len is capped there), so it is exactly the default frequencies.
- `longrope`: transformers uses the short factors while a call's sequence is within
  `original_max_position_embeddings` and the long ones past it. pagedserve fixes the choice per
  engine, from the served max_model_len (long iff it exceeds the original length, as vLLM does), so a
  cached prefix means one thing. Equal to transformers for every sequence when max_model_len <= the
  original length, and for sequences longer than it otherwise; the load log says which set is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int  # leading dims of each head that rotate (partial rotary: fewer than head_dim)
    rope_type: str = "default"
    # The type's parameters, as the config gives them (factor, low_freq_factor, short_factor, ...), as a
    # tuple of (key, value) pairs so the spec is hashable (one table per distinct spec).
    params: tuple = ()
    max_position_embeddings: int = 4096

    def param(self, key: str, default=None):
        return dict(self.params).get(key, default)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(spec: RopeSpec, max_model_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], attention factor multiplying cos and sin)."""
    dim, kind = spec.rotary_dim, spec.rope_type
    inv_freq = _default_inv_freq(spec.theta, dim)
    if kind in ("default", "dynamic"):
        # dynamic: transformers' rescaling starts past max_position_embeddings, which is never served.
        assert max_model_len <= spec.max_position_embeddings, (max_model_len, spec.max_position_embeddings)
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(spec.param("factor")), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, spec), 1.0
    if kind == "yarn":
        return _yarn(spec)
    if kind == "longrope":
        return _longrope(spec, max_model_len)
    raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def longrope_uses_long_factors(spec: RopeSpec, max_model_len: int) -> bool:
    return max_model_len > int(spec.param("original_max_position_embeddings"))


def rope_note(spec: RopeSpec, max_model_len: int) -> str | None:
    """What the load log says about a RoPE whose transformers behaviour depends on the call (LongRoPE)."""
    if spec.rope_type != "longrope":
        return None
    original = spec.param("original_max_position_embeddings")
    if longrope_uses_long_factors(spec, max_model_len):
        return (f"LongRoPE: long factors at every position (max_model_len {max_model_len} > original "
                f"{original}); transformers uses the short ones for sequences within {original} tokens: pass "
                f"--max-model-len {original} for them")
    return f"LongRoPE: short factors (max_model_len {max_model_len} <= original {original}), as transformers"


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    factor = float(spec.param("factor"))
    low, high = float(spec.param("low_freq_factor")), float(spec.param("high_freq_factor"))
    old_len = float(spec.param("original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base = spec.rotary_dim, spec.theta
    factor = spec.param("factor")
    original = spec.param("original_max_position_embeddings")
    if factor is None:
        factor = spec.max_position_embeddings / original
    attention_factor = spec.param("attention_factor")
    mscale, mscale_all_dim = spec.param("mscale"), spec.param("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = spec.param("beta_fast") or 32
    beta_slow = spec.param("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(spec: RopeSpec, max_model_len: int) -> tuple[torch.Tensor, float]:
    dim, base = spec.rotary_dim, spec.theta
    original = int(spec.param("original_max_position_embeddings"))
    factor = spec.param("factor")
    if factor is None:
        factor = spec.max_position_embeddings / original
    attention_factor = spec.param("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if longrope_uses_long_factors(spec, max_model_len) else "short_factor"
    ext = torch.tensor(spec.param(key), dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base ** shape), float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables `[max_model_len, rotary_dim / 2]` in float32 (the attention factor folded in),
    applied rotate-half style to the first `rotary_dim` dims of each head, as Hugging Face does."""

    def __init__(self, spec: RopeSpec, max_model_len: int, device: torch.device):
        inv_freq, attention_factor = rope_inv_freq(spec, max_model_len)
        t = torch.arange(max_model_len, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq.float()[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.spec = spec
        self.rotary_dim = spec.rotary_dim
        self.half = spec.rotary_dim // 2

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated copies in the input dtype."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half, rot = self.half, self.rotary_dim
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:rot]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if rot < x.shape[-1]:
            parts.append(xf[..., rot:])
        return torch.cat(parts, dim=-1).to(x.dtype)
