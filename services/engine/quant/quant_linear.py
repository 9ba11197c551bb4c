"""The linear layer over a quantized weight, the embedding over one, and activation quantization.

`QuantLinear(x)` computes `x @ w.T (+ bias)` for a `PanelWeight` w:
- bfloat16 on a CPU with AVX512-BF16: the C++ GEMM (kernels/cpu/quant_gemm.cpp) dequantizes inside the
  kernel; the weight stays packed in memory.
- CUDA (or the CPU under Triton's interpreter with PAGEDSERVE_QUANT_KERNEL=triton, for tests): the Triton
  GEMM (kernels/triton_quant_gemm.py) over the same packed layout, dequantizing inside the kernel.
- anything else (float32 or float16 on the CPU, a CPU without the kernel): the PyTorch reference, which
  dequantizes the weight for the call and runs F.linear. In float32 this is the specification the
  parity tests hold to transformers running the dequantized weights.

W8A8 checkpoints (compressed-tensors INT8 or FP8 with `input_activations`, `fp8` with its
`activation_scheme`) quantize the layer's input first, as the checkpoint was calibrated for
(`quantize_activation`): per token (dynamic), per tensor (dynamic, or static from `input_scale`), or per
1 x group along the input (block-wise FP8, dynamic). Dynamic FP8 without a stated granularity (`fp8`'s
`activation_scheme: dynamic`) is quantized per token, which keeps a sequence's output independent of
what it is batched with.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from services.engine.quant.panel_weight import PANEL, PanelWeight
from services.engine.quant.scheme import ActivationQuant

log = logging.getLogger(__name__)

FP8_MAX = 448.0
INT8_MAX = 127.0


def quantize_activation(x: torch.Tensor, act: ActivationQuant, input_scale: torch.Tensor | None,
                        reduce_max=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): the input's quantized values (as float32: e4m3 values or integers) and their scales, shaped
    to broadcast over q ([T, 1] per token, [1, 1] per tensor, [T, K] per group), so x ~ q * s.

    `reduce_max`: for a row-parallel layer under tensor parallelism, the group's in-place maximum: a rank
    holds only its slice of each input row, and a per-token or per-tensor scale is the whole row's absmax
    (groups along the input are split whole, so theirs need no reduction)."""
    xf = x.float()
    top = FP8_MAX if act.dtype == "fp8" else INT8_MAX
    if not act.dynamic:
        s = input_scale.float().reshape(1, 1).to(x.device)
    elif act.granularity in ("token", "tensor"):
        amax = xf.abs().amax(dim=-1, keepdim=True) if act.granularity == "token" else xf.abs().amax().reshape(1, 1)
        if reduce_max is not None:
            amax = reduce_max(amax.contiguous())
        s = amax.clamp_min(1e-12) / top
    else:  # 1 x group along the input
        t, k = xf.shape
        gs = act.group_size
        pad = (-k) % gs
        grouped = F.pad(xf, (0, pad)).view(t, -1, gs)
        s = (grouped.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / top).expand(-1, -1, gs)
        s = s.reshape(t, -1)[:, :k]
    if act.dtype == "fp8":
        q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        q = torch.round(xf / s).clamp(-128, 127)
    return q, s


def _cpu_kernel(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    from kernels.cpu import load

    mod = load()
    return mod if mod is not None and mod.quant_gemm_supported() else None


class QuantLinear:
    """`weight`: the resident packed weight; `bias`: [N] or None; `act` and `input_scale`: the checkpoint's
    activation quantization (None: weight-only)."""

    __slots__ = ("weight", "bias", "act", "input_scale", "dtype", "mod", "kernel_bias", "input_max_reduce", "triton")

    def __init__(self, weight: PanelWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                 act: ActivationQuant | None = None, input_scale: torch.Tensor | None = None):
        self.weight, self.act, self.dtype = weight, act, dtype
        self.input_scale = None if input_scale is None else input_scale.float().to(device)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.triton = device.type == "cuda" or os.environ.get("PAGEDSERVE_QUANT_KERNEL") == "triton"
        self.mod = None if self.triton else _cpu_kernel(device, dtype)
        self.kernel_bias = None
        # Set by the model on row-parallel layers under tensor parallelism (quantize_activation's reduce_max).
        self.input_max_reduce = None
        if (self.mod is not None or self.triton) and bias is not None:  # float32, padded to the panels
            self.kernel_bias = torch.zeros(weight.codes.shape[0] * PANEL, dtype=torch.float32, device=device)
            self.kernel_bias[:weight.out_features] = bias.float()

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        row_scale = None
        if self.act is not None:
            q, s = quantize_activation(x, self.act, self.input_scale, self.input_max_reduce)
            if self.mod is not None and s.shape[1] == 1:
                # q holds e4m3 values or integers in [-128, 127]: exact in bfloat16; the scale is applied to
                # the float32 accumulator, per row.
                x, row_scale = q.to(torch.bfloat16), s.expand(q.shape[0], 1).reshape(-1).contiguous()
            else:
                x = (q * s).to(self.dtype)
        if w.perm is not None:
            x = x.index_select(1, w.perm)
        if self.triton:
            import kernels

            return kernels.quant_gemm(x, w.codes, w.kind, w.group_size, w.scale, w.offset, w.zero, w.zero_const,
                                      w.out_features, self.kernel_bias)
        if self.mod is None:
            return F.linear(x, w.dequantize(x.dtype), self.bias)
        return self.mod.quant_gemm(x, w.codes, w.kind, w.group_size, w.scale, w.offset, w.zero, w.zero_const,
                                   w.out_features, self.kernel_bias, row_scale)

