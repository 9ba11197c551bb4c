"""Prefill attention on the CPU: fresh prompts over their own new keys, continuations over the cache.

A prompt computed whole in one step attends only to its own new keys, no gather back out of the
cache: in bfloat16 on AMX through `kernels/cpu/amx_prefill.cpp` (both products on the tiles; 1.5-1.8x
PyTorch's CPU flash attention at 32-512 tokens, up to AMX_PREFILL_MAX_TOKENS), on AVX512-BF16 without
AMX through `kernels/cpu/prefill_bf16.cpp` (both products as bf16 dot-product tiles; 1.8x PyTorch's CPU
flash attention at 512 tokens), otherwise causal SDPA.
Continuations (a chunk after earlier chunks, or after a prefix-cache hit) read their context from the
paged cache. Without AMX, long ones (GATHER_MIN_TOKENS new tokens or more) have their context gathered
out of the cache and go through the AVX512-BF16 kernel with the chunk's offset (not on AMX: see
`_gather_kernel`). The
rest, in bfloat16, go through the decode kernel in one call per layer: new token j of a chunk is a
query whose context ends at its own position. On AMX, consecutive tokens of a chunk share
every block before them, which the kernel's units read once for up to 16 query rows; on AVX-512 alone
the one call still beats a gather and a masked SDPA call per sequence (W3 +10% end to end on an AMD
EPYC). float32 keeps the masked SDPA call per sequence (batching them into one padded, masked SDPA call
was measured slower here).

A sliding window, logit soft-capping or attention sinks (`window`, `softcap`, `sinks`) take one route for
every sequence, fresh or continuing: in bfloat16 each new token as a decode query through the C++ kernel
(which reads only the window, and takes sinks), otherwise per sequence. There, sinks without a soft-cap
go through PyTorch's CPU flash attention, which also returns each row's log-sum-exp of the scaled scores
(lse), and the output is rescaled by Z / (Z + exp(sink)) = sigmoid(lse - sink), Z = exp(lse): exact, since
the sink only adds exp(sink) to the softmax's denominator, and 6-8x faster at 1-2k tokens than the
reference's score matrix with an extra sink column (2 threads). The rest run the PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.checks import check_options
from kernels.cpu import amx_in_use, load
from kernels.reference import causal_mask, prefill_attention_ref

# A continuation of at least this many new tokens is attended over its gathered context by the
# prefill kernel rather than token by token by the decode kernel. Measured on an AMD EPYC (2 threads):
# 1.1-1.2x for 64-512 new tokens over 448-2048 of context, 0.8x for 32 over 300.
GATHER_MIN_TOKENS = 64
# The longest fresh prompt the AMX prefill kernel takes; longer ones go to PyTorch's flash attention, whose
# blocked softmax catches up there. `pagedserve bench prefill-attention` on a 2-core Intel Xeon with AMX
# (docs/bench-prefill-attention-xeon-amx*.json): the kernel at 1.3-2.8x SDPA's speed for 32-512 tokens and
# 1.25x at 1,024 (head_dim 64); 1.09-1.14x at 1,536-2,048 in that run, 0.94-0.98x in an earlier one; at
# head_dim 128, 1.15x at 1,024 and 0.93x at 2,048.
AMX_PREFILL_MAX_TOKENS = 1024


def prefill_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor,
                          spans: list[tuple[int, int, int]], scale: float,
                          step_cache: dict | None = None, *, window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q/k/v: the new tokens of the prefill sequences, flattened; spans: (start, end, context_len).

    `step_cache` (one dict per step and KV group, shared by the group's layers) keeps each
    continuation's block index and causal mask, which are the same in every layer, so they are built
    once per step, not once per layer.
    """
    if window is not None or softcap is not None or sinks is not None:
        check_options("services.engine.cpu_prefill.prefill_attention_cpu", window, softcap, sinks, q)
        return _with_options(q, k_cache, v_cache, block_tables, spans, scale, step_cache, window, softcap, sinks)
    if step_cache is not None:
        # Which route a step takes is the same in every layer of the group: decided once per step.
        route = step_cache.get("route")
        if route is None:
            route = step_cache["route"] = _step_route(q, k_cache, spans)
        if route == "decodes":
            # Short continuations only (a speculative verify step, small chunks): the whole step is one
            # decode-kernel call over q as it is, no index_select or scatter per layer.
            _, tables, lens = _decode_entry(block_tables, spans, range(len(spans)), step_cache)
            return load().paged_decode(q, k_cache, v_cache, tables, lens, scale, 0, 0.0, None)
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    continuing = []
    for i, (start, end, ctx) in enumerate(spans):
        fresh_kernel = _fresh_kernel(q, end - start) if end - start == ctx else None
        if fresh_kernel is not None:
            out[start:end] = fresh_kernel(q[start:end], k[start:end], v[start:end], scale)
        elif end - start == ctx:
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                v[start:end].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)[0]
            out[start:end] = o.transpose(0, 1)
        else:
            continuing.append(i)
    gather_kernel = _gather_kernel(q)
    if continuing and gather_kernel is not None:
        # Long chunks: their context gathered once and attended by the prefill kernel, which reads each
        # key once for 16 query tokens; the AVX-512 decode kernel would read it once per token.
        short = []
        for i in continuing:
            start, end, ctx = spans[i]
            if end - start < GATHER_MIN_TOKENS:
                short.append(i)
                continue
            keys, values = _gathered_context(k_cache, v_cache, block_tables, i, ctx, step_cache, q.dtype)
            out[start:end] = gather_kernel(q[start:end], keys, values, scale, ctx - (end - start))
        continuing = short
        if not continuing:
            return out
    if continuing and _decode_kernel_takes(q, k_cache):
        _continuations_as_decodes(q, k_cache, v_cache, block_tables, spans, continuing, scale, out, step_cache)
        return out
    if step_cache is None:
        for i in continuing:
            start, end, ctx = spans[i]
            out[start:end] = prefill_attention_ref(q[start:end], k_cache, v_cache, block_tables[i:i + 1],
                                                   block_tables.new_tensor([0, end - start]),
                                                   block_tables.new_tensor([ctx]), scale)
        return out
    for i in continuing:
        start, end, ctx = spans[i]
        keys, values = _gathered_context(k_cache, v_cache, block_tables, i, ctx, step_cache, q.dtype)
        entry = step_cache[i]
        if entry.mask is None:
            q_len = end - start
            # New token j sits at position ctx - q_len + j and sees positions <= that.
            entry.mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], attn_mask=entry.mask, scale=scale,
                                           enable_gqa=gqa)[0]
        out[start:end] = o.transpose(0, 1)
    return out


def _step_route(q: torch.Tensor, k_cache: torch.Tensor, spans: list[tuple[int, int, int]]) -> str:
    """"decodes" where every sequence of the step continues a cached context and goes through the decode
    kernel below (a short continuation, or any continuation where the fresh-prompt kernel does not run);
    "mixed" otherwise."""
    if not spans or not _decode_kernel_takes(q, k_cache):
        return "mixed"
    short_only = _gather_kernel(q) is not None
    for start, end, ctx in spans:
        if end - start == ctx or (short_only and end - start >= GATHER_MIN_TOKENS):
            return "mixed"
    return "decodes"


@dataclass
class _ContextEntry:
    """What every layer of a step reuses for one continuing sequence."""

    blocks: torch.Tensor                # its context's cache blocks
    mask: torch.Tensor | None = None    # the chunk's causal mask, for the masked-SDPA route


def _gathered_context(k_cache, v_cache, block_tables, i: int, ctx: int, step_cache: dict | None,
                      dtype: torch.dtype):
    """Sequence i's first ctx cached keys and values, [ctx, kv_heads, dim] each (its new ones included), in
    `dtype` (an FP8 cache's e4m3 values widened; its scales are applied by the caller)."""
    entry = step_cache.get(i) if step_cache is not None else None
    if entry is None:
        entry = _ContextEntry(block_tables[i, :-(-ctx // k_cache.shape[1])].long())
        if step_cache is not None:
            step_cache[i] = entry
    blocks = entry.blocks
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    return (k_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:ctx].to(dtype),
            v_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:ctx].to(dtype))


def _fresh_kernel(q: torch.Tensor, tokens: int = 0):
    """The C++ kernel for a fresh prompt of `tokens` tokens, or None for SDPA. bfloat16 only, as for
    continuations (float32 keeps SDPA): the AMX kernel where AMX is in use (up to AMX_PREFILL_MAX_TOKENS),
    else the AVX512-BF16 one."""
    if q.dtype != torch.bfloat16:
        return None
    mod = load()  # None without a compiler or with PAGEDSERVE_CPU_KERNELS=0: SDPA then
    if mod is None:
        return None
    if amx_in_use():
        usable = mod.amx_prefill_supported(q.shape[2]) and tokens <= AMX_PREFILL_MAX_TOKENS
        return mod.amx_prefill if usable else None
    return mod.prefill_bf16 if mod.prefill_bf16_supported(q.shape[2]) else None


def _gather_kernel(q: torch.Tensor):
    """The kernel that attends long continuations over their gathered context, or None: then every
    continuation goes through the decode kernel. On AMX the decode kernel's units read each shared block
    once for up to 16 query rows and need no gather. Timed once on a 2-core Intel Xeon with AMX (30 layers'
    calls, alternating; an ad hoc script, not a bench command), gathering and the AMX prefill kernel took
    1.23x the decode route's time for 24 chunks of 64 tokens after a shared 384-token prefix (W3's shape),
    1.00x for 8 x 128, and 0.85x for 4 unshared chunks of 256 after 256: not worth a second route."""
    return None if amx_in_use() else _fresh_kernel(q)


def _decode_kernel_takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    # bfloat16 only: float32 keeps SDPA, whose results the float32 parity tests hold to transformers'.
    return q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and load() is not None


def _with_options(q, k_cache, v_cache, block_tables, spans, scale, step_cache, window, softcap, sinks):
    out = torch.empty_like(q)
    every = list(range(len(spans)))
    if _decode_kernel_takes(q, k_cache):
        _continuations_as_decodes(q, k_cache, v_cache, block_tables, spans, every, scale, out, step_cache,
                                  window=window, softcap=softcap, sinks=sinks)
        return out
    if sinks is not None and softcap is None and _FLASH_WITH_LSE is not None:
        _sinks_through_lse(q, k_cache, v_cache, block_tables, spans, scale, step_cache, window, sinks, out)
        return out
    for i in every:
        start, end, ctx = spans[i]
        out[start:end] = prefill_attention_ref(q[start:end], k_cache, v_cache, block_tables[i:i + 1],
                                               block_tables.new_tensor([0, end - start]),
                                               block_tables.new_tensor([ctx]), scale, window=window,
                                               softcap=softcap, sinks=sinks)
    return out


# PyTorch's CPU flash attention with its log-sum-exp (a private op: where a build lacks it, the reference).
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _sinks_through_lse(q, k_cache, v_cache, block_tables, spans, scale, step_cache, window, sinks, out):
    """Each sequence over its cached context by flash attention, then scaled by sigmoid(lse - sink) per
    (token, head): the sink's exp(sink) joins the denominator Z = exp(lse) and nothing else."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    for i, (start, end, ctx) in enumerate(spans):
        q_len = end - start
        if q_len == 0:
            continue
        keys, values = _gathered_context(k_cache, v_cache, block_tables, i, ctx, step_cache, q.dtype)
        # The op takes neither GQA nor a boolean mask: K/V repeated per query head, the mask additive.
        keys = keys.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)[None]
        values = values.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)[None]
        visible, causal = causal_mask(ctx - q_len, q_len, window, q.device)  # causal: a whole prompt
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        o, lse = _FLASH_WITH_LSE(q[start:end].transpose(0, 1)[None], keys, values, 0.0, causal, attn_mask=mask,
                                 scale=scale)
        keep = torch.sigmoid(lse[0].float() - sinks[:, None])  # [heads, q_len]
        out[start:end] = (o[0].float() * keep[..., None]).transpose(0, 1)


def _continuations_as_decodes(q, k_cache, v_cache, block_tables, spans, continuing, scale, out, step_cache,
                              window: int | None = None, softcap: float | None = None,
                              sinks: torch.Tensor | None = None):
    """Every new token of every continuation as one decode query over the cache (its KV is written)."""
    rows, tables, lens = _decode_entry(block_tables, spans, continuing, step_cache)
    out[rows] = load().paged_decode(q.index_select(0, rows), k_cache, v_cache, tables, lens, scale, window or 0,
                                    softcap or 0.0, sinks)


def _decode_entry(block_tables, spans, continuing, step_cache):
    """(rows, tables, lens) of the continuations' new tokens as decode queries: token j of a chunk is a query
    whose context ends at its own position. Built once per step (`step_cache`), the same in every layer."""
    entry = step_cache.get("decodes") if step_cache is not None else None
    if entry is None:
        rows, tables, lens = [], [], []
        for i in continuing:
            start, end, ctx = spans[i]
            rows.append(torch.arange(start, end))
            tables.append(block_tables[i].expand(end - start, -1))
            lens.append(torch.arange(ctx - (end - start) + 1, ctx + 1, dtype=torch.int32))
        entry = (torch.cat(rows), torch.cat(tables).contiguous(), torch.cat(lens))
        if step_cache is not None:
            step_cache["decodes"] = entry
    return entry
