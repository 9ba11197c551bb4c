"""Launch plumbing the Triton launchers share: where a kernel may run, dot precision, device size.

Kept free of `triton` imports so that `kernels.triton_available()` and the device checks can run on a
machine without Triton installed.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

# What the interpreter pretends the device's multiprocessor count is: small, so that the CPU tests
# exercise split-KV decode at context lengths the interpreter can afford.
INTERPRETER_NUM_SMS = 4


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET, read as Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def check_device(op: str, t: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter; say which twin to use."""
    if t.is_cuda or (t.device.type == "cpu" and interpreting()):
        return
    raise TypeError(f"{op} runs Triton kernels on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); "
                    f"got tensors on {t.device}: call {op}_ref instead")


def dot_precision(dtype: torch.dtype) -> str:
    # float32 on tensor cores defaults to tf32 (~1e-3 relative error); a float32 model asked for float32.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill (a stand-in under the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def check_tile(op: str, tile_n: int) -> None:
    # tl.arange needs a power of two, and tl.dot a dimension of at least 16.
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"{op}: tile_n must be a power of two >= 16, got {tile_n}")


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output and scratch buffer comes from here, so tests can swap in NaN-filled buffers
    and catch any element a kernel fails to write."""
    return torch.empty(shape, dtype=dtype, device=device)
