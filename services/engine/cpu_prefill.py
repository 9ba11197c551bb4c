"""Prefill attention on the CPU, shaped for PyTorch's flash-attention kernel.

A prompt computed whole in one step attends only to its own new keys: causal SDPA on them directly,
no gather back out of the cache. Continuations (a chunk after earlier chunks, or after a prefix-cache
hit) read their context from the paged cache through the reference, one call per sequence: batching
them into one padded, masked SDPA call was measured slower here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import prefill_attention_ref


def prefill_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor,
                          spans: list[tuple[int, int, int]], scale: float) -> torch.Tensor:
    """q/k/v: the new tokens of the prefill sequences, flattened; spans: (start, end, context_len)."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    continuing = []
    for i, (start, end, ctx) in enumerate(spans):
        if end - start == ctx:
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                v[start:end].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)[0]
            out[start:end] = o.transpose(0, 1)
        else:
            continuing.append(i)
    for i in continuing:
        start, end, ctx = spans[i]
        out[start:end] = prefill_attention_ref(q[start:end], k_cache, v_cache, block_tables[i:i + 1],
                                               block_tables.new_tensor([0, end - start]),
                                               block_tables.new_tensor([ctx]), scale)
    return out
