"""A GGUF file's tensors read as they are: ggml's block types decoded into `QuantizedWeight`s, never dequantized.

Served types: F32, F16, BF16 (plain), Q4_0, Q4_1, Q8_0 (blocks of 32 along the input), Q4_K, Q5_K (super-
blocks of 256 in eight groups of 32 with 6-bit scales and minima), Q6_K (sixteen groups of 16 with int8
scales). Any other type is refused naming the tensor and the type. Decoding follows ggml's block
layouts (llama.cpp's ggml-quants.c, the `gguf` package's quants.py):

    Q4_0  d f16 | 16 bytes: element i low nibble, element i+16 high nibble       w = d * (q - 8)
    Q4_1  d f16, m f16 | 16 bytes as Q4_0                                         w = d * q + m
    Q8_0  d f16 | 32 int8                                                         w = d * q
    Q4_K  d, dmin f16 | 12 bytes of 6-bit (scale, min) x 8 | 128 bytes: chunk c of 32 bytes holds group
          2c in its low nibbles and 2c+1 in its high ones                         w = d*sc * q - dmin*m
    Q5_K  as Q4_K, plus 32 bytes whose bit j is the fifth bit of group j          w = d*sc * q - dmin*m
    Q6_K  128 bytes low nibbles | 64 bytes of 2-bit highs | 16 int8 scales | d    w = d*sc * (q - 32)

Names are mapped to the Hugging Face Llama layout the loader reads (blk.N.attn_q -> layers.N.self_attn.
q_proj, token_embd -> embed_tokens, ...). llama.cpp stores a Llama's Q and K rows permuted for its RoPE
kernel; they are permuted back (as transformers does when it loads a GGUF file).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from services.engine.quant.packed_weight import QuantizedWeight

PLAIN = ("F32", "F16", "BF16")
SERVED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_IGNORED = {"rope_freqs.weight"}  # llama3 RoPE factors, recomputed from the config's rope_scaling


class GgufTypeError(ValueError):
    """A GGUF tensor of a type this engine does not read."""


def hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minima per super-block."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def decode(kind: str, raw: torch.Tensor, k: int, source: str) -> QuantizedWeight:
    """`raw`: uint8 [N, row bytes] of one ggml type -> the weight's codes and group parameters."""
    n = raw.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        b = raw.view(n, k // 32, size)
        d = _f16(b[..., 0:2])
        if kind == "Q8_0":
            codes = (b[..., 2:].view(torch.int8).int() + 128).to(torch.uint8)
            return QuantizedWeight(codes.reshape(n, k), 8, 32, d, zero_const=128, source=source)
        head = 2 if kind == "Q4_0" else 4
        codes = _nibbles(b[..., head:]).reshape(n, k)
        if kind == "Q4_0":
            return QuantizedWeight(codes, 4, 32, d, zero_const=8, source=source)
        return QuantizedWeight(codes, 4, 32, d, offset=_f16(b[..., 2:4]), source=source)
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        b = raw.view(n, k // 256, size)
        d, dmin = _f16(b[..., 0:2]).float(), _f16(b[..., 2:4]).float()
        sc, mn = _k_scale_min(b[..., 4:16])
        qs = b[..., -128:].reshape(n, k // 256, 4, 32)
        low = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, k // 256, 8, 32)  # group 2c, 2c+1
        bits = 4
        if kind == "Q5_K":
            qh = b[..., 16:48]  # [n, sb, 32]
            high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=2)  # [n, sb, 8, 32]
            low = low | (high << 4)
            bits = 5
        scale = (d[..., None] * sc.float()).reshape(n, -1)
        offset = -(dmin[..., None] * mn.float()).reshape(n, -1)
        return QuantizedWeight(low.reshape(n, k).contiguous(), bits, 32, scale, offset=offset, source=source)
    if kind == "Q6_K":
        b = raw.view(n, k // 256, 210)
        ql = b[..., 0:128].reshape(n, -1, 2, 64)
        ql = torch.stack([ql & 0xF, ql >> 4], dim=3).reshape(n, -1, 8, 32)  # [.., half, nibble, 64] order
        qh = b[..., 128:192].reshape(n, -1, 2, 32)
        qh = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(n, -1, 8, 32)
        codes = (ql | (qh << 4)).reshape(n, k)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [n, sb, 16]
        d = _f16(b[..., 208:210]).float()
        scale = (d[..., None] * sc).reshape(n, -1)
        return QuantizedWeight(codes.contiguous(), 6, 16, scale, zero_const=32, source=source)
    raise GgufTypeError(f"{source}: GGUF type {kind} is not served; served: {', '.join(PLAIN + SERVED)}")


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row indices undoing llama.cpp's Q/K permutation (transformers' reverse_permute_weights)."""
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


class GgufCheckpoint:
    """The tensors of a GGUF file by Hugging Face name ("model." dropped), read on demand from its mapping."""

    def __init__(self, path: Path):
        import gguf

        self.model_dir = Path(path)
        self.reader = gguf.GGUFReader(str(path))
        arch_field = self.reader.fields["general.architecture"]
        self.arch = str(arch_field.contents())
        self.where = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                if t.name in _IGNORED:
                    continue
                raise GgufTypeError(f"{path.name}: tensor {t.name!r} is not part of a {self.arch} model this engine "
                                    "reads")
            kind = t.tensor_type.name
            if kind not in PLAIN + SERVED:
                raise GgufTypeError(f"{path.name}: tensor {t.name!r} has GGUF type {kind}, which is not served; "
                                    f"served: {', '.join(PLAIN + SERVED)}")
            self.where[name] = t

        def field(key):
            f = self.reader.fields.get(f"{self.arch}.{key}")
            return None if f is None else int(f.contents())

        self.heads, self.kv_heads = field("attention.head_count"), field("attention.head_count_kv")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def type_of(self, name: str) -> str:
        return self.where[name].tensor_type.name

    def _rows_fix(self, name: str, n: int) -> torch.Tensor | None:
        if self.arch != "llama" or self.heads is None:
            return None
        if ".self_attn.q_proj." in name:
            return _unpermute_rows(n, self.heads)
        if ".self_attn.k_proj." in name:
            return _unpermute_rows(n, self.kv_heads or self.heads)
        return None

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor:
        """A plain tensor (norms, biases, F32/F16/BF16 weights), optionally rows/columns [a, b)."""
        if name not in self.where:
            raise KeyError(f"weight {name!r} missing from {self.model_dir}")
        t = self.where[name]
        kind = t.tensor_type.name
        if kind not in PLAIN:
            raise GgufTypeError(f"{name} is {kind} in {self.model_dir.name}; read it as a quantized weight")
        data = np.array(t.data)
        x = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16) if kind == "BF16" else torch.from_numpy(data)
        fix = self._rows_fix(name, x.shape[0])
        if fix is not None:
            x = x.index_select(0, fix)
        if rows is not None:
            x = x[rows[0]:rows[1]]
        if cols is not None:
            x = x[:, cols[0]:cols[1]]
        return x.contiguous()

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The weight `name` as stored, or None when it is a plain tensor."""
        t = self.where[name]
        kind = t.tensor_type.name
        if kind in PLAIN:
            return None
        k = int(t.shape[0])  # ggml's dimensions are innermost first
        raw = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1)
        qw = decode(kind, raw, k, f"gguf {kind} {name}")
        fix = self._rows_fix(name, qw.shape[0])
        return qw if fix is None else qw.take_rows(fix)
