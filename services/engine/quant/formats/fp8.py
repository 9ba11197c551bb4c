"""FP8 weights: float8_e4m3fn codes with per-tensor, per-channel or block-wise float32 scales.

`fp8` (DeepSeek-V3, Qwen3-FP8, transformers' FineGrainedFP8): `weight` e4m3 [N, K] with `weight_scale_inv`
[ceil(N/bn), ceil(K/bk)] for `weight_block_size` [bn, bk] (despite its name, multiplied: w = q * s), or
`weight_scale` (one per tensor). compressed-tensors `float-quantized`: `weight` e4m3 with `weight_scale` of
shape [1]/[] (tensor), [N, 1] (channel) or [ceil(N/bn), ceil(K/bk)] (block). Either may carry `input_scale`
(static activation quantization).
"""

from __future__ import annotations

import torch

from services.engine.quant.packed_weight import QuantizedWeight
from services.engine.quant.scheme import WeightQuant


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, source: str
               ) -> QuantizedWeight:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{source}: the weight is {weight.dtype}, not float8_e4m3fn")
    n, k = weight.shape
    scale = scale.float()
    if block is not None:
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want:
            raise ValueError(f"{source}: block scales are {tuple(scale.shape)}, blocks {block} of [{n}, {k}] "
                             f"give {want}")
        scale = scale.repeat_interleave(bn, dim=0)[:n].contiguous()
        group = bk
    elif scale.numel() == 1:
        scale, group = scale.reshape(1, 1).expand(n, 1).contiguous(), k
    elif tuple(scale.shape) in ((n, 1), (n,)):
        scale, group = scale.reshape(n, 1).contiguous(), k
    else:
        raise ValueError(f"{source}: a scale of shape {tuple(scale.shape)} is neither per tensor nor per channel")
    return QuantizedWeight(weight.view(torch.uint8).contiguous(), 8, group, scale, float8=True, source=source)


def read_fp8(read, name: str, wq: WeightQuant) -> QuantizedWeight:
    weight = read(name + ".weight")
    if wq.block is not None:
        return fp8_weight(weight, read(name + ".weight_scale_inv"), wq.block, "fp8 block-wise")
    return fp8_weight(weight, read(name + ".weight_scale"), None, "fp8")
