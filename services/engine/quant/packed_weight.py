"""One quantized weight matrix in the form every on-disk format is read into, and its PyTorch reference.

`QuantizedWeight` holds, for an [N, K] weight (N outputs, K inputs), one code per element and per-group
parameters along K:

    w[n, k] = scale[n, g] * (code[n, k] - zero[n, g])    with a zero point (GPTQ, AWQ, compressed-tensors)
    w[n, k] = scale[n, g] * code[n, k] + offset[n, g]    with an offset (GGUF Q4_1 and the K-quants' minima)
    g = k // group_size   (the last group may be shorter)

where `code` is an unsigned integer of `bits` bits, an e4m3 bit pattern (`float8`), or an e2m1 one
(`fp4`, MXFP4: w = FP4[code] * scale, no zero point). Scales keep the
checkpoint's dtype, so holding them costs what the file does. With act-order (GPTQ `desc_act`,
compressed-tensors `actorder`) the columns are stored sorted by group and `perm` says which input
column each one multiplies: the product is `x[:, perm] @ w_sorted.T`.

Codes are held unpacked (one per byte) while a model is being read: sharding for tensor parallelism
(`rows`, `cols`), fusing Q/K/V and gate/up (`cat_rows`) and permuting rows (GGUF's Q/K order) are plain
slicing then. `nbytes` is what the resident form costs (4-bit codes two to a byte), the figure the
engine's memory accounting reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# e2m1 (MXFP4) values by code: bit 3 is the sign, then two exponent bits and one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp4_lookup(codes: torch.Tensor) -> torch.Tensor:
    """The e2m1 values of codes (any shape, uint8 0..15), float32."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


class QuantizedShardError(ValueError):
    """A quantized weight cannot be split where tensor parallelism needs it split."""


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K]
    bits: int  # 4, 5, 6 or 8 (a float8 code is 8)
    group_size: int  # input columns per scale group
    scale: torch.Tensor  # [N, G] float16 / bfloat16 / float32
    zero: torch.Tensor | None = None  # [N, G] uint8 zero points
    zero_const: int = 0  # the zero point of every group when `zero` and `offset` are None
    offset: torch.Tensor | None = None  # [N, G] float: added after scaling (instead of a zero point)
    float8: bool = False  # codes are float8_e4m3fn bit patterns (zero point 0)
    fp4: bool = False  # codes are e2m1 bit patterns (MXFP4; zero point 0)
    perm: torch.Tensor | None = None  # [K] int64: stored column j multiplies input column perm[j]
    source: str = ""  # the format it was read from, for messages and figures ("gptq", "gguf Q4_1", ...)

    def __post_init__(self):
        n, k = self.codes.shape
        groups = -(-k // self.group_size)
        assert self.codes.dtype == torch.uint8, self.codes.dtype
        assert self.scale.shape == (n, groups), (self.scale.shape, n, groups)
        assert self.zero is None or (self.zero.shape == self.scale.shape and self.zero.dtype == torch.uint8)
        assert self.offset is None or self.offset.shape == self.scale.shape
        assert self.zero is None or self.offset is None
        assert self.perm is None or self.perm.shape == (k,)
        assert self.bits in (4, 5, 6, 8) and (not self.float8 or self.bits == 8) and (not self.fp4 or self.bits == 4)
        assert not (self.fp4 and (self.zero is not None or self.offset is not None or self.zero_const))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        n, k = self.codes.shape
        code_bytes = n * (-(-k // 2) if self.bits == 4 else k)
        extra = [t for t in (self.scale, self.zero, self.offset, self.perm) if t is not None]
        return code_bytes + sum(t.nbytes for t in extra)

    def group_index(self) -> torch.Tensor:
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight in input-column order, computed in float32 (one rounding per step, as the
        formats' own reference dequantizers do), then cast."""
        g = self.group_index()
        scale = self.scale.float()[:, g]
        if self.float8:
            w = self.codes.view(torch.float8_e4m3fn).float() * scale
        elif self.fp4:
            w = fp4_lookup(self.codes) * scale
        elif self.offset is not None:
            w = self.codes.float() * scale + self.offset.float()[:, g]
        else:
            zero = self.zero.float()[:, g] if self.zero is not None else float(self.zero_const)
            w = (self.codes.float() - zero) * scale
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w.to(dtype)

    def _per_row(self, f) -> QuantizedWeight:
        return replace(self, codes=f(self.codes), scale=f(self.scale), zero=None if self.zero is None else f(self.zero),
                       offset=None if self.offset is None else f(self.offset))

    def rows(self, a: int, b: int) -> QuantizedWeight:
        """Output rows [a, b) (a column-parallel shard)."""
        return self._per_row(lambda t: t[a:b].contiguous())

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        return self._per_row(lambda t: t.index_select(0, index).contiguous())

    def cols(self, a: int, b: int) -> QuantizedWeight:
        """Input columns [a, b) (a row-parallel shard): whole groups only."""
        k = self.codes.shape[1]
        if self.scale.shape[1] == 1 and self.perm is None:  # one group (per channel or tensor): any split
            return replace(self, codes=self.codes[:, a:b].contiguous(), group_size=b - a)
        if self.perm is not None:
            raise QuantizedShardError(f"{self.source}: an act-order weight (desc_act / g_idx) cannot be split along "
                                      "its input for tensor parallelism (its groups are spread over every rank)")
        if a % self.group_size or (b % self.group_size and b != k):
            raise QuantizedShardError(f"{self.source}: input columns [{a}, {b}) of {k} do not fall on the weight's "
                                      f"groups of {self.group_size}: pick a tensor-parallel size that splits "
                                      "whole groups")
        ga, gb = a // self.group_size, -(-b // self.group_size)

        def groups(t):
            return None if t is None else t[:, ga:gb].contiguous()

        return replace(self, codes=self.codes[:, a:b].contiguous(), scale=groups(self.scale), zero=groups(self.zero),
                       offset=groups(self.offset))

    def same_layout(self, other: QuantizedWeight) -> bool:
        """Can the two be stacked along their outputs into one weight?"""
        def same(a, b):
            return (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b)))

        return (self.codes.shape[1] == other.codes.shape[1] and self.bits == other.bits
                and self.group_size == other.group_size and self.float8 == other.float8 and self.fp4 == other.fp4
                and self.scale.dtype == other.scale.dtype and (self.zero is None) == (other.zero is None)
                and (self.offset is None) == (other.offset is None)
                and (self.offset is None or self.offset.dtype == other.offset.dtype)
                and (self.zero is not None or self.offset is not None or self.zero_const == other.zero_const)
                and same(self.perm, other.perm))


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked along their outputs (fused Q/K/V, gate/up); they must share a layout (same_layout)."""
    first = parts[0]
    assert all(first.same_layout(p) for p in parts[1:])

    def cat(name):
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.cat(ts)

    return replace(first, codes=cat("codes"), scale=cat("scale"), zero=cat("zero"), offset=cat("offset"))


def sort_by_group(codes: torch.Tensor, g_idx: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Act-order: (codes with columns sorted by group, perm), such that column j of the sorted codes belongs
    to group j // group_size and multiplies input column perm[j]. Every group must hold `group_size`
    columns (the last one possibly fewer), as GPTQ's act-order writes them."""
    k = codes.shape[1]
    g_idx = g_idx.long()
    counts = torch.bincount(g_idx, minlength=-(-k // group_size))
    expect = torch.full_like(counts, group_size)
    if k % group_size:
        expect[-1] = k % group_size
    if counts.shape != expect.shape or not torch.equal(counts, expect):
        raise ValueError(f"g_idx does not give every group {group_size} columns (counts {counts.tolist()[:8]}...)")
    perm = torch.sort(g_idx, stable=True).indices
    if torch.equal(perm, torch.arange(k)):
        return codes, None
    return codes[:, perm].contiguous(), perm
