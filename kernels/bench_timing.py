"""Timing for `kernels.bench` and the GPU check: kernel time by CUDA events, and the device's copy bandwidth.

Each timed call is preceded by a short GPU spin, so the host has queued the start event and the launch
before the GPU reaches them: what the events measure is the kernels, not Python launch overhead.
Callers rotate among input sets that together exceed the L2 cache, so repeats read device memory.
On the CPU (the dry runs that keep this code exercised without a GPU) the same calls are timed by the
wall clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

SPIN_CYCLES = 1_000_000  # ~0.5 ms at H200 clocks: longer than the host takes to enqueue a launch or two


def _spin() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SPIN_CYCLES)


def median_ms(calls: Sequence[Callable[[], object]], *, warmup: int = 5, reps: int = 30,
              device: torch.device | None = None) -> float:
    """Median milliseconds of one call, rotating through `calls` (one per input set), after warm-up."""
    for i in range(warmup):
        calls[i % len(calls)]()
    if device is not None and device.type == "cpu":
        times = []
        for i in range(reps):
            start = time.perf_counter()
            calls[(warmup + i) % len(calls)]()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    event = lambda: torch.cuda.Event(enable_timing=True)
    events = [(event(), event()) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        _spin()
        start.record()
        calls[(warmup + i) % len(calls)]()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms([lambda: dst.copy_(src)], warmup=3, reps=20, device=device)
    return 2 * nbytes / (ms * 1e-3)


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 32 << 20
    # Older PyTorch builds lack the attribute; 60 MB is the H100/H200 figure.
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20))
