"""Attention over the paged KV cache for one flattened batch: metadata and backend dispatch.

Tokens are laid out decodes first (one token each), then prefill chunks. Decodes go through the
batched decode kernel; prefill chunks through the chunked-prefill kernel. CUDA tensors use the Triton
kernels; on the CPU, decodes and KV writes use the compiled C++ kernels (kernels.cpu), and prefills go
through services/engine/cpu_prefill.py (SDPA for fresh prompts, the C++ decode kernel for
continuations where AMX runs it, masked SDPA otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels.cpu import decode_attention_cpu, write_kv_cpu
from services.engine.cpu_prefill import prefill_attention_cpu


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefill_seqs, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefill_seqs + 1] int32, relative to num_decode
    prefill_context_lens: torch.Tensor | None  # [num_prefill_seqs] int32
    # (q_start, q_end, context_len) per prefill sequence, relative to num_decode, as Python ints.
    prefill_spans: list[tuple[int, int, int]] | None = None
    step_cache: dict | None = None  # per-step scratch shared by all layers (CPU prefill masks)


class PagedAttention:
    def __init__(self, device: torch.device):
        on_cuda = device.type == "cuda"
        self.write_kv = kernels.write_kv if on_cuda else write_kv_cpu
        self.decode = kernels.decode_attention if on_cuda else decode_attention_cpu
        self.on_cuda = on_cuda
        self.prefill = kernels.prefill_attention if on_cuda else kernels.prefill_attention_ref

    def _run_prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self.on_cuda and meta.prefill_spans is not None:
            return prefill_attention_cpu(q, k, v, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_spans,
                                         scale, meta.step_cache)
        return self.prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                            meta.prefill_context_lens, scale)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens) -> [T, Hq, D]."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode
        if nd == q.shape[0]:
            return self.decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        if nd == 0:
            return self._run_prefill(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                               scale)
        out[nd:] = self._run_prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale)
        return out
