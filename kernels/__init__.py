"""Paged-attention kernels: Triton versions (CUDA, or the CPU under TRITON_INTERPRET=1), C++ kernels for
the CPU (kernels.cpu) and PyTorch references that specify them all.

Public API: write_kv, decode_attention, prefill_attention and their *_ref twins, same signatures. The
engine's attention backend (services/engine/attention.py) picks Triton on CUDA and kernels.cpu on the
CPU; the references are the fallback when the C++ kernels cannot be built, and what tests judge by.
Mixture-of-experts: fused_experts (Triton), fused_experts_cpu (+ pack_experts_cpu, or linear_experts_cpu for
experts that are callables, e.g. quantized linears) and fused_experts_ref,
same leading signature; group_by_expert / align_block_size, the grouping they share.

Importing this package imports neither Triton nor torch: the engine imports it on CPU-only machines,
Triton must see TRITON_INTERPRET before its kernels are defined, and torch-free processes (router,
scheduler) read `kernels.cache`. Each Triton entry point imports its module on first call, and the
references load on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_REFERENCES = ("decode_attention_ref", "prefill_attention_ref", "write_kv_ref")
# Torch-only MoE entry points (no Triton), loaded on first use like the references.
_MOE = {"fused_experts_ref": "moe_reference", "moe_activation": "moe_reference",
        "fused_experts_cpu": "moe_cpu", "pack_experts_cpu": "moe_cpu", "linear_experts_cpu": "moe_cpu",
        "group_by_expert": "moe_align", "align_block_size": "moe_align"}


def __getattr__(name: str):
    if name in _REFERENCES:
        return getattr(importlib.import_module("kernels.reference"), name)
    if name in _MOE:
        return getattr(importlib.import_module(f"kernels.{_MOE[name]}"), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def triton_available() -> bool:
    """Triton installed? The kernels then run on CUDA, or on the CPU under TRITON_INTERPRET=1."""
    return importlib.util.find_spec("triton") is not None


def _launcher(module: str, name: str):
    try:
        return getattr(importlib.import_module(f"kernels.{module}"), name)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ModuleNotFoundError(f"kernels.{name} needs Triton (pip install 'pagedserve[triton]'); "
                                  f"on the CPU call kernels.{name}_ref", name="triton") from e


def quant_gemm(x: torch.Tensor, codes: torch.Tensor, kind: int, group_size: int, scale: torch.Tensor,
               offset: torch.Tensor | None, zero: torch.Tensor | None, zero_const: float, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T (+ bias)` over a packed quantized weight (services/engine/quant/panel_weight.py's layout),
    dequantized inside the Triton kernel; the C++ `kernels.cpu` quant_gemm's twin for CUDA."""
    return _launcher("triton_quant_gemm", "quant_gemm")(x, codes, kind, group_size, scale, offset, zero, zero_const,
                                                         out_features, bias)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, slots_checked: bool = False) -> None:
    """Scatter new keys/values `[num_tokens, num_kv_heads, head_dim]` into their slots; slot -1 is skipped.

    `slots_checked=True`: the caller checked the slots on the host; nothing is read back from the device.
    """
    _launcher("triton_write_kv", "write_kv")(k, v, k_cache, v_cache, slot_mapping, slots_checked=slots_checked)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                     max_context_len: int | None = None, num_splits: int | None = None,
                     window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context (GQA, split-KV).

    Returns `[num_seqs, num_q_heads, head_dim]`; see `decode_attention_ref`. With `max_context_len`
    (host-side) the launch reads nothing back from the device; `num_splits` overrides the heuristic.
    `window`, `softcap`, `sinks`: see kernels.reference.
    """
    launch = _launcher("triton_decode", "decode_attention")
    return launch(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=max_context_len,
                  num_splits=num_splits, window=window, softcap=softcap, sinks=sinks)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                      scale: float, *, max_query_len: int | None = None,
                      max_context_len: int | None = None, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked prefill over paged KV, causal within each sequence.

    Returns `[num_tokens, num_q_heads, head_dim]`; see `prefill_attention_ref`. With both maxima given
    (host-side) the launch reads nothing back from the device. `window`, `softcap`, `sinks`: see
    kernels.reference.
    """
    launch = _launcher("triton_prefill", "prefill_attention")
    return launch(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                  max_query_len=max_query_len, max_context_len=max_context_len, window=window,
                  softcap=softcap, sinks=sinks)


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str = "silu", *, b_gate_up: torch.Tensor | None = None,
                  b_down: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,  # moe_reference's
                  alignment=None, ids_checked: bool = False) -> torch.Tensor:
    """A MoE layer's experts on Triton: `[T, H]`, see `fused_experts_ref` (layouts in kernels.moe_reference).

    `alignment`: this call's `align_block_size(topk_ids, E, block_m)` if the caller made it;
    `ids_checked=True`: the caller checked the expert ids, so nothing is read back from the device.
    On the CPU use `fused_experts_cpu`.
    """
    launch = _launcher("triton_fused_moe", "fused_experts")
    return launch(x, w_gate_up, w_down, topk_ids, topk_weights, activation, b_gate_up=b_gate_up, b_down=b_down,
                  alpha=alpha, limit=limit, alignment=alignment, ids_checked=ids_checked)


__all__ = [
    "align_block_size", "decode_attention", "decode_attention_ref", "fused_experts", "fused_experts_cpu",
    "fused_experts_ref", "group_by_expert", "linear_experts_cpu", "moe_activation", "pack_experts_cpu",
    "prefill_attention", "quant_gemm",
    "prefill_attention_ref", "triton_available", "write_kv", "write_kv_ref",
]
