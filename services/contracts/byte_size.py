"""How a size in bytes is spelled wherever a person writes one: flags, env vars, chart values, `LLM(...)`.

One parser, so `--kv-cache-memory 4G` on the command line, `PAGEDSERVE_KV_CACHE_MEMORY=4G` in a pod and
`LLM(kv_cache_memory="4G")` mean the same number of bytes in every process.
"""

from __future__ import annotations


def parse_bytes(text: str | int) -> int:
    """'4G', '4GiB', '4GB' -> 4 GiB; plain integers are bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in scale:
        return int(float(s[:-1]) * scale[s[-1]])
    return int(s)
