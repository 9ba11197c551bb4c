"""What loading a rank's weights cost in memory: the weights' bytes, the KV cache's, and the peak.

The peak is measured, not computed: on the CPU the growth of the process's peak resident set while
the weights load (Linux: VmHWM is reset first through /proc/self/clear_refs, so what ran before in
this process does not count), on CUDA the device's peak allocation. With tensor parallelism every
rank reports its own, and rank 0 logs them side by side (a rank must hold 1/N of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weight_bytes: int
    kv_cache_bytes: int
    load_peak_bytes: int  # -1: not measurable here

    def describe(self) -> str:
        peak = "n/a" if self.load_peak_bytes < 0 else f"{self.load_peak_bytes / 2**20:.1f} MiB"
        return (f"rank {self.rank}: weights {self.weight_bytes / 2**20:.1f} MiB, KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB, peak while loading {peak}")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class LoadPeak:
    """Brackets the loading: `start()` before, `bytes()` after."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base: int | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        except OSError:
            self.base = None
            return
        rss = _status_kib("VmRSS")
        self.base = None if rss is None else rss * 1024

    def bytes(self) -> int:
        if self.base is None:
            return -1
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        peak = _status_kib("VmHWM")
        return -1 if peak is None else peak * 1024 - self.base
