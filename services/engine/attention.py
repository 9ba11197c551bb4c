"""Attention over the paged KV cache for one flattened batch: the step's metadata and three backends.

Tokens are laid out decodes first (one token each), then prefill chunks. Decodes go through the
batched decode kernel; prefill chunks through the chunked-prefill kernel. The backend is chosen
independently of the device (`--attention-backend`; by default Triton on CUDA, the C++ kernels on the
CPU):

- `triton`: the Triton kernels (kernels/triton_*), on CUDA or, under TRITON_INTERPRET=1, on the CPU
  through Triton's interpreter (slow; tests). Given the host-side numbers in `AttentionMetadata`, they
  read nothing back from the device: no sync inside a layer, and decode steps can be CUDA-graph captured.
- `cpu`: the compiled C++ kernels (kernels.cpu) for decodes and KV writes; prefills through
  services/engine/cpu_prefill.py (SDPA for fresh prompts, the C++ decode kernel for continuations where
  AMX runs it, masked SDPA otherwise). CPU tensors only.
- `reference`: the PyTorch references (kernels.reference), on any device: the specification. They read
  index tensors on the host (a sync per call on CUDA), so they are never captured in a CUDA graph.

Every backend takes a layer's options the same way: its sliding `window` (None: full attention), the
model's attention-logit `softcap` (None: none) and its attention `sinks` (gpt-oss: a float32 logit per
query head on the device, which joins the softmax's denominator and adds no value; None: none), besides
the scale. All three combine, with each other and with GQA and an FP8 cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import kernels
from kernels.triton_common import interpreting
from services.engine.kv_cache_fp8 import attend_fp8

BACKENDS = ("triton", "cpu", "reference")


@dataclass(frozen=True)
class AttentionMetadata:
    """Device index tensors of a step plus the host-side numbers that size the kernels' grids."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1: padding, written nowhere
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, width] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32
    decode_max_context_len: int
    decode_num_splits: int | None  # split-KV programs per (sequence, KV head); Triton only
    prefill_block_tables: torch.Tensor | None  # [num_prefill_seqs, width] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefill_seqs + 1] int32, relative to num_decode
    prefill_context_lens: torch.Tensor | None  # [num_prefill_seqs] int32
    prefill_max_query_len: int = 0
    prefill_max_context_len: int = 0
    # (q_start, q_end, context_len) per prefill sequence, relative to num_decode, as Python ints.
    prefill_spans: list[tuple[int, int, int]] | None = None
    step_cache: dict | None = None  # per-step scratch shared by one KV group's layers (CPU prefill masks)


def resolve_backend(name: str | None, device: torch.device) -> str:
    """The backend to run: `auto`/None picks by device; a backend that cannot run here is a clear error."""
    if name in (None, "auto"):
        return "triton" if device.type == "cuda" else "cpu"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs the C++ CPU kernels; the engine's device is {device}")
    if name == "triton":
        if not kernels.triton_available():
            raise ValueError("attention_backend 'triton' needs Triton: pip install 'pagedserve[triton]'")
        if device.type == "cpu" and not interpreting():
            raise ValueError("attention_backend 'triton' on the CPU runs through Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before starting (slow; meant for tests)")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"attention_backend 'triton' runs on CUDA (or the CPU interpreter), not {device}")
    return name


class TritonBackend:
    captures_graphs = True

    def __init__(self, device: torch.device):
        from kernels import triton_common, triton_decode

        self._choose_splits = triton_decode.choose_num_splits
        self._sms = triton_common.num_sms(device)

    def num_splits(self, num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
        return self._choose_splits(num_seqs, num_kv_heads, max_context_len, self._sms)

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, slots_checked=True)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> torch.Tensor:
        return kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                        scale, max_context_len=meta.decode_max_context_len,
                                        num_splits=meta.decode_num_splits, **options)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> torch.Tensor:
        return kernels.prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                         meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
                                         max_query_len=meta.prefill_max_query_len,
                                         max_context_len=meta.prefill_max_context_len, **options)


class CpuBackend:
    captures_graphs = False

    def __init__(self, device: torch.device):
        from kernels.cpu import decode_attention_cpu, write_kv_cpu
        from services.engine.cpu_prefill import prefill_attention_cpu

        self._decode, self._write_kv, self._prefill = decode_attention_cpu, write_kv_cpu, prefill_attention_cpu

    def num_splits(self, num_seqs: int, num_kv_heads: int, max_context_len: int) -> None:
        return None

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                            **options)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> torch.Tensor:
        return self._prefill(q, k, v, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_spans, scale,
                             meta.step_cache, **options)


class ReferenceBackend:
    captures_graphs = False

    def __init__(self, device: torch.device):
        pass

    def num_splits(self, num_seqs: int, num_kv_heads: int, max_context_len: int) -> None:
        return None

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        kernels.write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> torch.Tensor:
        return kernels.decode_attention_ref(q, k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, scale, **options)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> torch.Tensor:
        return kernels.prefill_attention_ref(q, k_cache, v_cache, meta.prefill_block_tables,
                                             meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
                                             **options)


_BACKEND_CLASSES = {"triton": TritonBackend, "cpu": CpuBackend, "reference": ReferenceBackend}


class PagedAttention:
    """One layer's attention over the flattened batch, through the chosen backend."""

    def __init__(self, backend: str, device: torch.device):
        self.name = resolve_backend(backend, device)
        self.backend = _BACKEND_CLASSES[self.name](device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 kv_scales: tuple[float, float] | None = None, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens) -> [T, Hq, D]. `kv_scales`: an FP8 cache's per-tensor
        (k_scale, v_scale) (services/engine/kv_cache_fp8.py); `window`, `softcap`, `sinks`: the layer's sliding
        window, attention-logit soft-cap and per-query-head sink logits ([Hq] float32, kernels.reference)."""
        # Only options that are set are passed on: the common call stays the plain one.
        options = {}
        if window is not None:
            options["window"] = window
        if softcap is not None:
            options["softcap"] = softcap
        if sinks is not None:
            options["sinks"] = sinks
        if kv_scales is not None:
            return attend_fp8(functools.partial(self._attend, **options), q, k, v, k_cache, v_cache, meta, scale,
                              kv_scales)
        return self._attend(q, k, v, k_cache, v_cache, meta, scale, **options)

    def _attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                raw: tuple[torch.Tensor, torch.Tensor] | None = None, **options) -> torch.Tensor:
        """`raw`: what to write into the cache when it is not k and v themselves (an FP8 cache's e4m3 values)."""
        b = self.backend
        b.write_kv(*(raw if raw is not None else (k, v)), k_cache, v_cache, meta)
        nd = meta.num_decode
        if nd == q.shape[0]:
            return b.decode(q, k_cache, v_cache, meta, scale, **options)
        if nd == 0:
            return b.prefill(q, k, v, k_cache, v_cache, meta, scale, **options)
        out = torch.empty_like(q)
        out[:nd] = b.decode(q[:nd], k_cache, v_cache, meta, scale, **options)
        out[nd:] = b.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale, **options)
        return out
