"""A model's projections read from a quantized checkpoint, sharded and fused, in their resident form.

The model loader asks for a projection by the modules it fuses (q/k/v, gate/up, or one module) and the
rows or columns this rank holds. Each module is read by its scheme's format reader (or as a plain
`weight` where the checkpoint left it unquantized), sliced to the rank's shard, and the parts are
stacked into one packed weight when their layouts and activation quantization agree exactly. When they
do not (act-order parts with different permutations, per-part static input scales, a quantized part
next to a plain one), the parts stay apart as a `SplitProjection` whose outputs are concatenated: never
an approximation to make them fit.

`build_linear` turns any of these into the callable the model runs (services/engine/quant/quant_linear.py
for packed weights, the model's own linear factory for plain ones). It is what any model family's
projections go through, not only Llama's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.quant.formats import compressed_tensors, fp8, gptq_awq
from services.engine.quant.packed_weight import QuantizedWeight, cat_rows
from services.engine.quant.panel_weight import PanelWeight
from services.engine.quant.quant_linear import QuantLinear
from services.engine.quant.scheme import ActivationQuant, QuantScheme

Range = tuple[int, int] | None

_READERS = {"fp8": fp8.read_fp8, "ct-fp8": compressed_tensors.read_float, "ct-int8": compressed_tensors.read_int8,
            "ct-packed": compressed_tensors.read_packed, "gptq": gptq_awq.read_gptq, "awq": gptq_awq.read_awq}


@dataclass
class QuantizedProjection:
    weight: PanelWeight
    act: ActivationQuant | None = None
    input_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def out_features(self) -> int:
        return self.weight.out_features


@dataclass
class SplitProjection:
    parts: list  # QuantizedProjection | torch.Tensor, in output order

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Projection = torch.Tensor | QuantizedProjection | SplitProjection


class QuantizedCheckpoint:
    """`ckpt`: services.engine.model_loader.Checkpoint (names without the "model." prefix)."""

    def __init__(self, ckpt, scheme: QuantScheme | None, device: torch.device, dtype: torch.dtype):
        """`scheme`: the checkpoint's quantization_config; None for a GGUF file (types stored per tensor)."""
        self.ckpt, self.scheme, self.device, self.dtype = ckpt, scheme, device, dtype

    def _read(self, name: str, optional: bool = False) -> torch.Tensor | None:
        if name not in self.ckpt:
            if optional:
                return None
            raise KeyError(f"{name!r} is missing from {self.ckpt.model_dir}, though its quantization_config "
                           f"({self.scheme.describe()}) says the checkpoint stores it")
        return self.ckpt.read(name)

    def _part(self, module: str, rows: Range, cols: Range) -> tuple[QuantizedWeight | torch.Tensor, object, object]:
        if self.scheme is None:  # GGUF: each tensor says its type
            qw = self.ckpt.quantized(module + ".weight")
            if qw is None:
                return self.ckpt.read(module + ".weight", rows, cols), None, None
            return _slice(qw, rows, cols), None, None
        full = module if module == "lm_head" else "model." + module
        # Hugging Face formats quantize linear layers only: the token embedding stays as it is.
        ls = None if module == "embed_tokens" else self.scheme.for_module(full)
        if ls is None:
            return self.ckpt.read(module + ".weight", rows, cols), None, None
        try:
            qw = _slice(_READERS[ls.weight.layout](self._read, module, ls.weight), rows, cols)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{module}: {e}") from e
        scale = self._read(module + ".input_scale", optional=True) if ls.activation is not None else None
        if ls.activation is not None and not ls.activation.dynamic and scale is None:
            raise KeyError(f"{module}.input_scale is missing: the checkpoint's activations are quantized statically")
        return qw, ls.activation, scale

    def projection(self, modules: list[str], rows: list[Range] | None = None, cols: Range = None,
                   pad_rows: int | None = None) -> Projection:
        """The modules' weights stacked along their outputs, each sliced to `rows[i]` / `cols`; `pad_rows`:
        zero rows appended up to that many (a vocabulary shard)."""
        rows = rows or [None] * len(modules)
        parts = [self._part(m, r, cols) for m, r in zip(modules, rows, strict=True)]
        if pad_rows is not None:
            assert len(parts) == 1
            parts = [(_pad_rows(parts[0][0], pad_rows), *parts[0][1:])]
        if all(isinstance(p[0], torch.Tensor) for p in parts):
            return torch.cat([p[0] for p in parts]).to(device=self.device, dtype=self.dtype).contiguous()
        first = parts[0]
        fusable = all(isinstance(p[0], QuantizedWeight) and first[0].same_layout(p[0]) and p[1] == first[1]
                      and _same(p[2], first[2]) for p in parts)
        if fusable:
            return self._resident(cat_rows([p[0] for p in parts]), first[1], first[2])
        return SplitProjection([self._resident(*p) if isinstance(p[0], QuantizedWeight)
                                else p[0].to(device=self.device, dtype=self.dtype).contiguous() for p in parts])

    def _resident(self, qw: QuantizedWeight, act, scale) -> QuantizedProjection:
        return QuantizedProjection(PanelWeight.of(qw, self.device), act, scale)


def _slice(qw: QuantizedWeight, rows: Range, cols: Range) -> QuantizedWeight:
    if rows is not None:
        qw = qw.rows(*rows)
    if cols is not None:
        qw = qw.cols(*cols)
    return qw


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _pad_rows(w, rows: int):
    n = w.shape[0]
    if n == rows:
        return w
    if isinstance(w, torch.Tensor):
        return torch.cat([w, w.new_zeros(rows - n, *w.shape[1:])])
    pad = QuantizedWeight(torch.zeros(rows - n, w.shape[1], dtype=torch.uint8), w.bits, w.group_size,
                          torch.zeros(rows - n, w.scale.shape[1], dtype=w.scale.dtype),
                          zero=None if w.zero is None else torch.zeros(rows - n, w.zero.shape[1], dtype=torch.uint8),
                          zero_const=w.zero_const,
                          offset=None if w.offset is None else torch.zeros(rows - n, w.offset.shape[1],
                                                                           dtype=w.offset.dtype),
                          float8=w.float8, fp4=w.fp4, perm=w.perm, source=w.source)
    return cat_rows([w, pad])


class SplitLinear:
    """Parts run one by one, outputs side by side (parts that cannot share one packed weight exactly)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def build_linear(p: Projection, bias: torch.Tensor | None, plain: Callable, dtype: torch.dtype,
                 device: torch.device):
    """The callable computing `x @ p.T + bias`; `plain(weight, bias)`: the model's linear for a plain tensor."""
    if isinstance(p, torch.Tensor):
        return plain(p, bias)
    if isinstance(p, QuantizedProjection):
        return QuantLinear(p.weight, bias, dtype, device, p.act, p.input_scale)
    sizes = [q.out_features if isinstance(q, QuantizedProjection) else q.shape[0] for q in p.parts]
    biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
    return SplitLinear([build_linear(q, b, plain, dtype, device) for q, b in zip(p.parts, biases, strict=True)])


def embed_tokens(embed: torch.Tensor | QuantizedProjection, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a token embedding, plain or packed (GGUF keeps `token_embd` quantized)."""
    if isinstance(embed, torch.Tensor):
        return torch.nn.functional.embedding(ids, embed)
    return embed.weight.dequantize_rows(ids, dtype)
