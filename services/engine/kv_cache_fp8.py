"""The FP8 KV cache (`--kv-cache-dtype fp8`, vLLM's spelling): float8_e4m3fn elements, per-tensor scales.

A key is stored as e4m3(k / k_scale) (saturated at +-448) and read as e4m3 * k_scale; values likewise. The
scales are per layer, from the checkpoint where it has them (`self_attn.k_scale` / `v_scale`, as
compressed-tensors' kv_cache_scheme and vLLM's FP8 checkpoints write them), else 1.0 as in vLLM.

Every attention backend reads the cache's raw e4m3 values (widened to the queries' dtype) and the scales
are applied outside it: k_scale folds into the softmax scale (q . k * k_scale * scale) and v_scale
multiplies the output. New tokens go through the same rounding before a prefill attends over them, so a
prompt computes the same whether its blocks came from the prefix cache or were just written, and a
preempted sequence recomputes what it had.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8 if kv_cache_dtype in ("fp8", "fp8_e4m3") else model_dtype


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def attend_fp8(attend, q, k, v, k_cache, v_cache, meta, scale: float, kv_scales: tuple[float, float]):
    """`attend(q, k, v, k_cache, v_cache, meta, scale)` over an FP8 cache: new keys and values rounded to
    e4m3 (written to the cache and handed to the prefill as the same raw values), scales applied outside.
    The layer's options (window, softcap, sinks) come bound into `attend`; a sink is a logit of its own, not
    a q.k product, so k_scale leaves it alone, and it adds no value, so v_scale's product still holds."""
    assert k_cache.dtype == FP8, k_cache.dtype
    k_scale, v_scale = kv_scales
    kq, vq = to_fp8(k, k_scale), to_fp8(v, v_scale)
    out = attend(q, kq.to(q.dtype), vq.to(q.dtype), k_cache, v_cache, meta, scale * k_scale, raw=(kq, vq))
    return out.mul_(v_scale) if v_scale != 1.0 else out


def read_kv_scales(ckpt, num_layers: int) -> list[tuple[float, float]] | None:
    """Per-layer (k_scale, v_scale) from a checkpoint (None when it has none)."""
    found = []
    for i in range(num_layers):
        p = f"layers.{i}.self_attn."
        if p + "k_scale" in ckpt and p + "v_scale" in ckpt:
            found.append((float(ckpt.read(p + "k_scale").float().reshape(-1)[0]),
                          float(ckpt.read(p + "v_scale").float().reshape(-1)[0])))
        elif p + "kv_scale" in ckpt:  # one scale for both (older FP8 checkpoints)
            s = float(ckpt.read(p + "kv_scale").float().reshape(-1)[0])
            found.append((s, s))
        else:
            return None if not found else _missing(i)
    return found


def _missing(layer: int):
    raise ValueError(f"the checkpoint has FP8 KV cache scales for some layers but not for layer {layer}")
