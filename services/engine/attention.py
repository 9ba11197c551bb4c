"""Attention over the paged KV cache for one flattened batch: metadata and backend dispatch.

Tokens are laid out decodes first (one token each), then prefill chunks. Decodes go through the
batched decode kernel; prefill chunks through the chunked-prefill kernel. CUDA tensors use the Triton
kernels; on the CPU, decodes use the compiled C++ kernel (kernels.cpu) and prefills the PyTorch
reference, whose SDPA call is already an efficient CPU flash-attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels.cpu import decode_attention_cpu


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32
    prefill_block_tables: torch.Tensor | None  # [num_prefill_seqs, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefill_seqs + 1] int32, relative to num_decode
    prefill_context_lens: torch.Tensor | None  # [num_prefill_seqs] int32


class PagedAttention:
    def __init__(self, device: torch.device):
        on_cuda = device.type == "cuda"
        self.write_kv = kernels.write_kv if on_cuda else kernels.write_kv_ref
        self.decode = kernels.decode_attention if on_cuda else decode_attention_cpu
        self.prefill = kernels.prefill_attention if on_cuda else kernels.prefill_attention_ref

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hk, D] (new tokens) -> [T, Hq, D]."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode
        if nd == q.shape[0]:
            return self.decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        if nd == 0:
            return self.prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                meta.prefill_context_lens, scale)
        out = torch.empty_like(q)
        out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                               scale)
        out[nd:] = self.prefill(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                meta.prefill_query_start_loc, meta.prefill_context_lens, scale)
        return out
