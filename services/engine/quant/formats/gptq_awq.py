"""GPTQ and AWQ checkpoints: int32-packed 4/8-bit codes with float16 group scales and packed zero points.

GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K*bits/32, N] packed along the input, `qzeros` int32
[G, N*bits/32] packed along the output, `scales` [G, N], `g_idx` int32 [K] (the group of each input column;
act-order when it is not k // group_size). w = scale * (q - zero); the `gptq` checkpoint format stores
zero - 1 (AutoGPTQ's convention, read as stored + 1 as its kernels do), `gptq_v2` the zero itself.
AWQ (AutoAWQ, version gemm): `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8], both packed along the
output in the order 0 2 4 6 1 3 5 7, `scales` [G, N]; w = scale * (q - zero).
"""

from __future__ import annotations

import torch

from services.engine.quant.formats.int_packing import unpack_awq, unpack_int32
from services.engine.quant.packed_weight import QuantizedWeight, sort_by_group
from services.engine.quant.scheme import WeightQuant


def read_gptq(read, name: str, wq: WeightQuant) -> QuantizedWeight:
    """`read(tensor_name)` -> tensor; `name`: the module ("layers.0.mlp.down_proj")."""
    bits = wq.bits
    qweight, qzeros, scales = read(name + ".qweight"), read(name + ".qzeros"), read(name + ".scales")
    n = qweight.shape[1]
    codes = unpack_int32(qweight, bits, 0).T.contiguous()  # [N, K]
    k = codes.shape[1]
    zeros = unpack_int32(qzeros, bits, 1)[:, :n].T.contiguous().int() + wq.zero_offset
    group = wq.group_size or k
    if scales.shape != (-(-k // group), n):
        raise ValueError(f"{name}.scales is {tuple(scales.shape)}; bits {bits} and group_size {wq.group_size} "
                         f"of a [{n}, {k}] weight give {(-(-k // group), n)}")
    g_idx = read(name + ".g_idx", optional=True)
    perm = None
    if g_idx is not None:
        codes, perm = sort_by_group(codes, g_idx, group)
    return QuantizedWeight(codes, bits, group, scales.T.contiguous(), zero=zeros.to(torch.uint8), perm=perm,
                           source=f"gptq {bits}-bit")


def read_awq(read, name: str, wq: WeightQuant) -> QuantizedWeight:
    qweight, qzeros, scales = read(name + ".qweight"), read(name + ".qzeros"), read(name + ".scales")
    codes = unpack_awq(qweight).T.contiguous()  # [N, K]
    n, k = codes.shape
    group = wq.group_size or k
    if scales.shape != (-(-k // group), n):
        raise ValueError(f"{name}.scales is {tuple(scales.shape)}; group_size {wq.group_size} of a [{n}, {k}] "
                         f"weight gives {(-(-k // group), n)}")
    zeros = unpack_awq(qzeros)[:, :n].T.contiguous()
    return QuantizedWeight(codes, 4, group, scales.T.contiguous(), zero=zeros, source="awq 4-bit")

