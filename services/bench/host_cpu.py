"""The machine a benchmark ran on, in words every report prints: CPU model, cores, the vector extensions
the CPU kernels choose between (AVX2, AVX-512, AVX512-BF16, AMX), read from /proc/cpuinfo."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe_cpu() -> str:
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    ext = ["AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX-512"]
    if "avx512f" in flags:
        ext.append("AVX512-BF16" if "avx512_bf16" in flags else "no AVX512-BF16")
    ext.append("AMX" if "amx_tile" in flags else "no AMX")
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores, {', '.join(ext)}"
