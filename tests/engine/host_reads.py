"""A guard that fails on any host read of a tensor's contents: on a GPU, each is a device-to-host sync.

`no_host_reads()` installs a TorchFunctionMode that raises `HostReadError` on `.item()`, `.tolist()`,
`.cpu()`, `.numpy()`, `bool(t)` (a data-dependent branch), `int(t)`, `float(t)`, `t.__index__`,
`torch.equal`, formatting a tensor, `x in t`, `.to("cpu")`, and ops whose output shape depends on the
data (`nonzero`, `x[mask]`, `unique`, ...), which make the host wait. On the CPU every tensor the engine
touches stands for a device tensor, so this proves on a machine without a GPU that a forward makes
no sync. Kernel launches are exempt: Triton's interpreter copies arguments to numpy to run a kernel,
which on a GPU is the kernel itself reading device memory.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__format__,
    torch.Tensor.__repr__, torch.Tensor.__contains__, torch.Tensor.__array__, torch.equal, torch.allclose,
    torch.Tensor.equal, torch.Tensor.allclose,
}


# Ops whose output shape depends on tensor contents: the host waits for the device to learn it.
_SHAPE_FROM_DATA = {
    torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.masked_select, torch.Tensor.masked_select,
    torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.bincount, torch.Tensor.bincount,
}


class HostReadError(AssertionError):
    pass


def _to_host(args, kwargs) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


def _mask_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _syncs(func, args, kwargs) -> bool:
    if func in _READS or func in _SHAPE_FROM_DATA:
        return True
    if func is torch.Tensor.to:
        return _to_host(args, kwargs)
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_):
        return _mask_index(args[1])  # x[mask]: as many rows as the mask has True
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) and \
            kwargs.get("output_size") is None
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    return False


class NoHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.paused = 0
        self.checked = 0  # torch calls seen outside kernel launches (proves the guard was active)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self.checked += 1
            if _syncs(func, args, kwargs):
                name = getattr(func, "__qualname__", repr(func))
                where = "".join(traceback.format_stack(limit=6)[:-1])
                raise HostReadError(f"host read of a device tensor: {name}\n{where}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def kernel_launches_exempt(mode: NoHostReads):
    """Pause the guard inside Triton's interpreter (its launches copy arguments to the host)."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        yield
        return
    launch = GridExecutor.__call__

    def paused(self, *args, **kwargs):
        mode.paused += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    GridExecutor.__call__ = paused
    try:
        yield
    finally:
        GridExecutor.__call__ = launch


@contextlib.contextmanager
def no_host_reads():
    mode = NoHostReads()
    with kernel_launches_exempt(mode), mode:
        yield mode


def guard_forward(model) -> list[NoHostReads]:
    """Wrap `model.forward` so every call runs under the guard; returns the list of guards used."""
    forward = model.forward
    guards: list[NoHostReads] = []

    def guarded(*args, **kwargs):
        with no_host_reads() as guard:
            guards.append(guard)
            return forward(*args, **kwargs)

    model.forward = guarded
    return guards
