"""How a size in bytes is spelled wherever a person writes one: flags, env vars, chart values, `LLM(...)`.

One parser, so `--kv-cache-memory 4G` on the command line, `PAGEDSERVE_KV_CACHE_MEMORY=4G` in a pod and
`LLM(kv_cache_memory="4G")` mean the same number of bytes in every process.
"""

from __future__ import annotations

import math
import re

_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# A number (digits with an optional fraction), then an optional K/M/G/T, "i" and "B": 4G, 4GiB, 4GB, 1.5g, 512.
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?$")


def parse_bytes(text: str | int) -> int:
    """'4G', '4GiB', '4GB' -> 4 GiB; plain integers are bytes. Raises ValueError for anything else: a
    negative or non-finite size, an unknown suffix, or no number at all."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"a size in bytes is an integer or a string such as '4G', not {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size in bytes cannot be negative, got {text}")
        return text
    m = _SIZE.match(text.strip().upper())
    if m is None:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 4G, 512M, 1.5G, 1048576)")
    value = float(m.group(1)) * _SCALE[m.group(2)]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large a size in bytes")
    return int(value)
