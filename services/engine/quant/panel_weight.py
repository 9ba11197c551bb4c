"""The resident form of a quantized weight: codes and group parameters in 64-column panels.

One layout serves every path: the C++ GEMM (kernels/cpu/quant_gemm.cpp) reads it directly, the PyTorch
reference dequantizes from it, and a quantized embedding (GGUF's `token_embd`, tied to the LM head)
gathers its rows from it, so a tied weight is held once.

    codes  u8 / fp8: [panels, K/2, 64, 2] as [panels, K/2, 128];  u4 / fp4 (MXFP4's e2m1): [panels, K/2, 64]
           (k even: low nibble)
    scale, offset, zero: [panels, groups, 64]

N is padded to whole panels and K to whole pairs with zero codes and zero scales (padding weighs 0).
Scales stay float16 where the checkpoint's are (float16, or float32/bfloat16 values float16 holds
exactly), else float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.quant.packed_weight import QuantizedWeight, fp4_lookup

PANEL = 64
KIND_U8, KIND_U4, KIND_FP8, KIND_FP4 = 0, 1, 2, 3


def _compact(t: torch.Tensor) -> torch.Tensor:
    """float16 when it holds every value exactly, else float32."""
    if t.dtype == torch.float16:
        return t
    f = t.float()
    h = f.half()
    return h if torch.equal(h.float(), f) else f


def _panels(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, G] -> [panels, G, 64], zero rows past N."""
    n, g = t.shape
    padded = t.new_zeros(rows, g)
    padded[:n] = t
    return padded.view(rows // PANEL, PANEL, g).transpose(1, 2).contiguous()


def _unpanel(t: torch.Tensor, n: int) -> torch.Tensor:
    p, g, _ = t.shape
    return t.transpose(1, 2).reshape(p * PANEL, g)[:n]


@dataclass
class PanelWeight:
    codes: torch.Tensor
    kind: int
    group_size: int  # even; a single group spans K rounded up to pairs
    scale: torch.Tensor
    offset: torch.Tensor | None
    zero: torch.Tensor | None
    zero_const: float
    out_features: int
    in_features: int
    perm: torch.Tensor | None
    source: str

    @classmethod
    def of(cls, qw: QuantizedWeight, device: torch.device | None = None) -> PanelWeight:
        n, k = qw.shape
        rows = -(-n // PANEL) * PANEL
        pairs = -(-k // 2)
        codes = torch.zeros(rows, pairs * 2, dtype=torch.uint8)
        codes[:n, :k] = qw.codes
        if qw.bits == 4:
            kind = KIND_FP4 if qw.fp4 else KIND_U4
            nib = codes[:, 0::2] | (codes[:, 1::2] << 4)
            packed = nib.view(rows // PANEL, PANEL, pairs).transpose(1, 2).contiguous()
        else:
            kind = KIND_FP8 if qw.float8 else KIND_U8
            packed = codes.view(rows // PANEL, PANEL, pairs, 2).transpose(1, 2).reshape(rows // PANEL, pairs,
                                                                                         2 * PANEL).contiguous()
        groups = qw.scale.shape[1]
        group_size = qw.group_size if groups > 1 else pairs * 2
        if group_size % 2:
            raise ValueError(f"{qw.source}: groups of {group_size} columns are odd; the quantized GEMM needs "
                             "whole pairs of columns per group")
        put = (lambda t: t) if device is None else (lambda t: t.to(device))
        return cls(codes=put(packed), kind=kind, group_size=group_size, scale=put(_panels(_compact(qw.scale), rows)),
                   offset=None if qw.offset is None else put(_panels(_compact(qw.offset), rows)),
                   zero=None if qw.zero is None else put(_panels(qw.zero, rows)), zero_const=float(qw.zero_const),
                   out_features=n, in_features=k, perm=None if qw.perm is None else put(qw.perm), source=qw.source)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.offset, self.zero, self.perm) if t is not None)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.out_features * self.in_features)

    def _codes_of(self, panel: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """Codes of the rows at (panel, column-in-panel) indices, [R, K_padded] uint8."""
        if self.kind in (KIND_U4, KIND_FP4):
            nib = self.codes[panel, :, col]  # [R, K/2]
            return torch.stack([nib & 0xF, nib >> 4], dim=-1).flatten(1)
        c = self.codes.view(self.codes.shape[0], self.codes.shape[1], PANEL, 2)
        return c[panel, :, col, :].flatten(1)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` of the weight, [R, K] in stored-column order, computed in float32 then cast."""
        rows = rows.long()
        panel, col = rows // PANEL, rows % PANEL
        codes = self._codes_of(panel, col)[:, :self.in_features]
        g = torch.arange(self.in_features, device=codes.device) // self.group_size
        scale = self.scale[panel, :, col].float()[:, g]
        if self.kind == KIND_FP8:
            return (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)
        if self.kind == KIND_FP4:
            return (fp4_lookup(codes) * scale).to(dtype)
        if self.offset is not None:
            w = codes.float() * scale + self.offset[panel, :, col].float()[:, g]
        else:
            zero = self.zero[panel, :, col].float()[:, g] if self.zero is not None else self.zero_const
            w = (codes.float() - zero) * scale
        return w.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole [N, K] weight in stored-column order (apply `perm` to the input, not to this)."""
        return self.dequantize_rows(torch.arange(self.out_features, device=self.codes.device), dtype)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(scale, offset, zero) as [N, G] again (tests)."""
        n = self.out_features
        return (_unpanel(self.scale, n), None if self.offset is None else _unpanel(self.offset, n),
                None if self.zero is None else _unpanel(self.zero, n))
