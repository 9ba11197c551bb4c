"""C++ kernels for the CPU backend, compiled on first use with the local compiler (cached afterwards).

The PyTorch references stay the specification: tests hold these kernels to them. When no compiler is
available the engine falls back to the references, slower but identical in result.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
_SOURCES = [str(_HERE / n) for n in ("paged_decode.cpp", "amx_decode.cpp", "fused_ops.cpp")]
_HEADERS = [_HERE / "widen.h", _HERE / "simd_exp.h"]


def _build_name() -> str:
    # torch's build cache notices edited sources but not headers: name the build after all of them.
    import hashlib

    digest = hashlib.sha256(b"".join(Path(p).read_bytes() for p in [*_SOURCES, *_HEADERS])).hexdigest()[:10]
    return f"pagedserve_cpu_kernels_{digest}"
_module = None
_failed = False


def load():
    """The compiled extension, or None when it cannot be built here (logged once)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        _failed = True
        return None
    try:
        from torch.utils.cpp_extension import load as load_ext

        _module = load_ext(name=_build_name(), sources=_SOURCES, extra_include_paths=[str(_HERE)],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported flags: keep serving on the references
        log.warning("CPU attention kernels unavailable (%s); using the PyTorch references", e)
        _failed = True
        return None
    if os.environ.get("PAGEDSERVE_CPU_AMX", "1") == "0":
        _module.set_amx_enabled(False)
    return _module


def decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    mod = load()
    if mod is None:
        from kernels.reference import decode_attention_ref

        return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    return mod.paged_decode(q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale)


def write_kv_cpu(k, v, k_cache, v_cache, slot_mapping) -> None:
    mod = load()
    if mod is None or slot_mapping.dtype != torch.long:
        from kernels.reference import write_kv_ref

        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    mod.write_kv(k, v, k_cache, v_cache, slot_mapping)
