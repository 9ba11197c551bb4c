"""Linear layers for the engine: plain `F.linear`, or oneDNN with weights packed once at load time.

On the CPU in bfloat16, `F.linear` reorders each weight into oneDNN's blocked layout on every call,
which for decode-sized batches costs as much as the product itself. Packing once at load time (what
vLLM's CPU backend does too) removes that. float32 keeps `F.linear`, whose results match Hugging Face.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class Linear:
    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    __slots__ = ("packed", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def _packing_works(dtype: torch.dtype) -> bool:
    try:
        w = torch.randn(32, 16, dtype=dtype)
        x = torch.randn(4, 16, dtype=dtype)
        got = PackedLinear(w, None, 4)(x)
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except Exception as e:  # an older torch or a CPU without oneDNN's bf16 path
        log.info("oneDNN weight packing unavailable (%s); using F.linear", e)
        return False


def make_linear_factory(device: torch.device, dtype: torch.dtype, batch_hint: int = 64):
    """Returns `build(weight, bias) -> callable` suited to this device and dtype."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available() \
            and _packing_works(dtype):
        return lambda w, b=None: PackedLinear(w, b, batch_hint)
    return lambda w, b=None: Linear(w, b)
