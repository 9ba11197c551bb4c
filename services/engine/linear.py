"""Linear layers for the engine: plain `F.linear`, or a GEMM over weights packed once at load time.

On the CPU in bfloat16, `F.linear` reorders each weight into oneDNN's blocked layout on every call,
which for decode-sized batches costs as much as the product itself. Packing once at load time (what
vLLM's CPU backend does too) removes that. On CPUs with AMX, oneDNN's AMX GEMM over the packed weight
is the fastest there is; on AVX512-BF16 CPUs without it (most AMD EPYCs, older Xeons), pagedserve's
own register-blocked kernel (`kernels/cpu/bf16_gemm.cpp`) runs instead: 2-4x oneDNN at 1-8 rows (the
batches of low-load decoding), 1.0-1.3x at 16-256, even at 2048. `PAGEDSERVE_CPU_GEMM=onednn|avx512` forces one.
float32 keeps `F.linear`, whose results match Hugging Face.
"""

from __future__ import annotations

import logging
import os

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


class Bf16GemmLinear:
    __slots__ = ("mod", "packed", "bias", "out_features")

    def __init__(self, mod, weight: torch.Tensor, bias: torch.Tensor | None):
        self.mod = mod
        self.packed = mod.bf16_gemm_pack(weight.contiguous())
        self.out_features = weight.shape[0]
        self.bias = None
        if bias is not None:  # float32, padded to the packed panels, added before the one rounding
            self.bias = torch.zeros(self.packed.shape[0] * self.packed.shape[2], dtype=torch.float32)
            self.bias[:self.out_features] = bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mod.bf16_gemm(x, self.packed, self.out_features, self.bias)


def cpu_gemm_choice() -> str:
    """Which bfloat16 CPU GEMM the engine uses here: "avx512" (pagedserve's kernel) or "onednn"."""
    forced = os.environ.get("PAGEDSERVE_CPU_GEMM", "auto")
    if forced not in ("auto", "onednn", "avx512"):
        raise ValueError(f"PAGEDSERVE_CPU_GEMM={forced!r}: expected auto, onednn or avx512")
    from kernels.cpu import amx_in_use, load

    mod = load()
    ours = mod is not None and mod.bf16_gemm_supported()
    if forced == "onednn" or not ours:
        return "onednn"
    if forced == "avx512":
        return "avx512"
    return "onednn" if amx_in_use() else "avx512"


def _packing_works(dtype: torch.dtype) -> bool:
    try:
        # Small integers: every product and sum is exact in half precision, so the probe compares exactly
        # and cannot fail on rounding (random normals failed it by chance, depending on the RNG state).
        g = torch.Generator().manual_seed(0)
        w = torch.randint(-2, 3, (32, 16), generator=g).to(dtype)
        x = torch.randint(-2, 3, (4, 16), generator=g).to(dtype)
        got = PackedLinear(w, None, 4)(x)
        return bool(torch.equal(got.float(), F.linear(x.float(), w.float())))
    except Exception as e:  # an older torch or a CPU without oneDNN's bf16 path
        log.info("oneDNN weight packing unavailable (%s); using F.linear", e)
        return False


def make_linear_factory(device: torch.device, dtype: torch.dtype, batch_hint: int = 64):
    """Returns `build(weight, bias) -> callable` suited to this device and dtype."""
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_gemm_choice() == "avx512":
        from kernels.cpu import load

        mod = load()
        log.info("bfloat16 linears: pagedserve's AVX512-BF16 GEMM (no AMX in use)")
        return lambda w, b=None: Bf16GemmLinear(mod, w, b)
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available() \
            and _packing_works(dtype):
        return lambda w, b=None: PackedLinear(w, b, batch_hint)
    return lambda w, b=None: Linear(w, b)
