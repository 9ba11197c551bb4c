"""What a rank's weights and KV cache take, and how much memory the process held before loading.

`weight_bytes` and `kv_cache_bytes` are the tensors' sizes; `start_bytes` is what was already in use
when loading began (the process's resident set on the CPU, the device's allocations on CUDA), so that
peak minus start is what this rank's model cost, measured. With tensor parallelism every rank reports
its own and rank 0 logs them side by side: a rank holds 1/N of the weights. (On the CPU a float32
checkpoint stays mapped from its file, paged in at the first forward: the peak is read after it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weight_bytes: int
    kv_cache_bytes: int
    start_bytes: int  # -1: unknown

    def describe(self) -> str:
        return (f"rank {self.rank}: weights {self.weight_bytes / 2**20:.1f} MiB, KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB")


def _status_bytes(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def memory_in_use(device: torch.device) -> int:
    """The process's resident set (CPU) or the device's allocated bytes (CUDA); -1 where unknown."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_bytes("self", "VmRSS")


def peak_resident(pid: int | str = "self") -> int:
    """A process's peak resident set so far (Linux VmHWM); -1 where unknown."""
    return _status_bytes(pid, "VmHWM")
