"""compressed-tensors checkpoints (llm-compressor's output), one reader per `format`.

- `pack-quantized`: `weight_packed` int32 [N, K*bits/32] packed along the input, lowest bits first, each
  value stored unsigned (signed + 2^(bits-1)); `weight_scale` [N, G] (group) or [N, 1] (channel);
  asymmetric: `weight_zero_point` packed the same way along the output ([N*bits/32, G]), or unpacked
  int8 [N, G] as older releases wrote it; act-order: `weight_g_idx` [K]; `weight_shape` [2].
  w = scale * (q_signed - zero_signed).
- `int-quantized` / `naive-quantized` (INT8): `weight` int8 [N, K], `weight_scale` per tensor, channel or
  group, `weight_zero_point` int8 when asymmetric.
- `float-quantized` (FP8): services/engine/quant/formats/fp8.py.
"""

from __future__ import annotations

import torch

from services.engine.quant.formats.fp8 import fp8_weight
from services.engine.quant.formats.int_packing import unpack_int32
from services.engine.quant.packed_weight import QuantizedWeight, sort_by_group
from services.engine.quant.scheme import WeightQuant


def _scale_and_group(scale: torch.Tensor, n: int, k: int, wq: WeightQuant, name: str) -> tuple[torch.Tensor, int]:
    if wq.group_size is None:  # channel or tensor
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(n, 1).contiguous(), k
        if tuple(scale.shape) in ((n, 1), (n,)):
            return scale.reshape(n, 1).contiguous(), k
    elif tuple(scale.shape) == (n, -(-k // wq.group_size)):
        return scale.contiguous(), wq.group_size
    raise ValueError(f"{name}.weight_scale is {tuple(scale.shape)}, which does not fit a [{n}, {k}] weight with "
                     f"group_size {wq.group_size}")


def _act_order(read, name: str, codes: torch.Tensor, group: int, wq: WeightQuant):
    g_idx = read(name + ".weight_g_idx", optional=True) if wq.act_order else None
    if g_idx is None or bool((g_idx < 0).all()):
        return codes, None
    return sort_by_group(codes, g_idx, group)


def read_packed(read, name: str, wq: WeightQuant) -> QuantizedWeight:
    bits, offset = wq.bits, 1 << (wq.bits - 1)
    shape = read(name + ".weight_shape").tolist()
    n, k = int(shape[0]), int(shape[1])
    codes = unpack_int32(read(name + ".weight_packed"), bits, 1)[:n, :k].contiguous()
    scale, group = _scale_and_group(read(name + ".weight_scale"), n, k, wq, name)
    zero = None
    if not wq.symmetric:
        zp = read(name + ".weight_zero_point")
        if zp.dtype == torch.int32 and zp.shape[0] != n:  # packed along the output
            zero = unpack_int32(zp, bits, 0)[:n].contiguous()
        else:
            zero = (zp.reshape(n, -1).int() + offset).to(torch.uint8)
        if zero.shape != scale.shape:
            raise ValueError(f"{name}.weight_zero_point is {tuple(zero.shape)}, its scales {tuple(scale.shape)}")
    codes, perm = _act_order(read, name, codes, group, wq)
    return QuantizedWeight(codes, bits, group, scale, zero=zero, zero_const=offset, perm=perm,
                           source=f"compressed-tensors pack-quantized {bits}-bit")


def read_int8(read, name: str, wq: WeightQuant) -> QuantizedWeight:
    weight = read(name + ".weight")
    if weight.dtype != torch.int8:
        raise ValueError(f"{name}.weight is {weight.dtype}, not int8")
    n, k = weight.shape
    codes = (weight.int() + 128).to(torch.uint8)
    scale, group = _scale_and_group(read(name + ".weight_scale"), n, k, wq, name)
    zero = None
    if not wq.symmetric:
        zp = read(name + ".weight_zero_point").int()
        zp = zp.reshape(1, 1).expand_as(scale) if zp.numel() == 1 else zp.reshape(scale.shape)
        zero = (zp + 128).to(torch.uint8).contiguous()
    codes, perm = _act_order(read, name, codes, group, wq)
    return QuantizedWeight(codes, 8, group, scale, zero=zero, zero_const=128, perm=perm,
                           source="compressed-tensors int8")


def read_float(read, name: str, wq: WeightQuant) -> QuantizedWeight:
    return fp8_weight(read(name + ".weight"), read(name + ".weight_scale"), wq.block, "compressed-tensors fp8")
