"""The compiled variants of the Triton kernels the engine launches: how many there are (a count that must
not grow while serving) and each one's registers and spills (read on the device by the GPU check).

Triton compiles one variant per distinct specialization of a kernel's arguments (constexprs, dtypes,
16-byte alignment of pointers, integers equal to 1 or divisible by 16 unless `do_not_specialize`).
Reads Triton's per-device kernel cache; under the interpreter nothing compiles and every count is 0.
"""

from __future__ import annotations


def engine_kernels() -> dict:
    """name -> the @triton.jit function (or the interpreter's stand-in) of every kernel the engine runs."""
    from kernels import triton_decode, triton_prefill, triton_token_bitmask, triton_write_kv

    return {"decode": triton_decode._decode_split_kernel, "decode reduce": triton_decode._decode_reduce_kernel,
            "prefill": triton_prefill._prefill_kernel, "write_kv": triton_write_kv._write_kv_kernel,
            "token bitmask": triton_token_bitmask._apply_token_bitmask_kernel}


def _compiled(fn) -> list:
    caches = getattr(fn, "device_caches", None) or {}
    out = []
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            out.extend(cache.values())
    return out


def compiled_counts() -> dict[str, int]:
    return {name: len(_compiled(fn)) for name, fn in engine_kernels().items()}


def compiled_resources() -> list[dict]:
    """Per compiled variant: kernel, warps, registers a thread, bytes spilled (None where unknown)."""
    rows = []
    for name, fn in engine_kernels().items():
        for k in _compiled(fn):
            meta = getattr(k, "metadata", None)
            rows.append(dict(kernel=name, num_warps=getattr(meta, "num_warps", None),
                             n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                             shared=getattr(meta, "shared", None)))
    return rows
