"""C++ kernels for the CPU backend, compiled on first use with the local compiler (cached afterwards).

The PyTorch references stay the specification: tests hold these kernels to them. When no compiler is
available the engine falls back to the references, slower but identical in result.
"""

from __future__ import annotations

import logging
import os

import torch

from kernels.checks import check_options

log = logging.getLogger(__name__)
_module = None
_failed = False


def load():
    """The compiled extension, or None when it cannot be built here (logged once).

    The build (kernels.cpu.build) is keyed by everything that changes it, cached under the pagedserve
    cache, and its lock cannot go stale; a wait on another process's compile is bounded.
    """
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        _failed = True
        return None
    from kernels.cpu.build import build

    try:
        _module = build()
    except Exception as e:  # no compiler, no ninja, unsupported flags, a compile that never ends
        log.warning("CPU attention kernels unavailable (%s); using the PyTorch references", e)
        _failed = True
        return None
    if os.environ.get("PAGEDSERVE_CPU_AMX", "1") == "0":
        _module.set_amx_enabled(False)
    return _module


def amx_in_use() -> bool:
    """Whether this machine runs the AMX paths (the CPU has the tiles and PAGEDSERVE_CPU_AMX is not 0).
    Where it does, oneDNN's and PyTorch's own AMX kernels are the ones to beat, so the AVX512-BF16
    GEMM and prefill kernels, written for CPUs without AMX, stand aside."""
    mod = load()
    return mod is not None and mod.amx_available() and os.environ.get("PAGEDSERVE_CPU_AMX", "1") != "0"


def bf16_gemm_choice() -> str:
    """Which bfloat16 GEMM the CPU linears use here: "avx512" (`bf16_gemm`, pagedserve's kernel) or
    "onednn". The rule of services/engine/linear.py's cpu_gemm_choice (the dense layers), kept here too so
    that kernels (the MoE experts, kernels.moe_cpu) take the same path without importing services:
    PAGEDSERVE_CPU_GEMM=onednn|avx512 forces one; otherwise ours where it is built and AMX is not in use."""
    forced = os.environ.get("PAGEDSERVE_CPU_GEMM", "auto")
    if forced not in ("auto", "onednn", "avx512"):
        raise ValueError(f"PAGEDSERVE_CPU_GEMM={forced!r}: expected auto, onednn or avx512")
    mod = load()
    if forced == "onednn" or mod is None or not mod.bf16_gemm_supported():
        return "onednn"
    if forced == "avx512":
        return "avx512"
    return "onednn" if amx_in_use() else "avx512"


def decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale: float, *,
                         window: int | None = None, softcap: float | None = None, sinks=None):
    """`window`, `softcap`, `sinks`: as in kernels.reference (the C++ kernel's generic path takes all three;
    the AVX512-BF16 one takes sinks too; the AMX one none, so calls with options skip it)."""
    check_options("kernels.cpu.decode_attention_cpu", window, softcap, sinks, q)
    mod = load()
    if mod is None:
        from kernels.reference import decode_attention_ref

        return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window=window,
                                    softcap=softcap, sinks=sinks)
    return mod.paged_decode(q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale,
                            window or 0, softcap or 0.0, sinks)


def write_kv_cpu(k, v, k_cache, v_cache, slot_mapping) -> None:
    mod = load()
    if mod is None or slot_mapping.dtype != torch.long:
        from kernels.reference import write_kv_ref

        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    mod.write_kv(k, v, k_cache, v_cache, slot_mapping)
