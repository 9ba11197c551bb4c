"""PyTorch paged attention: the reference for the Triton kernels and the engine's CPU backend.

KV layout per layer: `k_cache`, `v_cache` shaped `[num_blocks, block_size, num_kv_heads, head_dim]`;
token slot = `block_id * block_size + offset`.

Options every attention entry point takes (keyword-only, the same on every backend):
- `window`: a query at position p sees keys at positions p - window + 1 .. p only (None: all earlier
  ones), as transformers' sliding-window mask; block-table entries before the window are never read.
- `softcap`: scores become `softcap * tanh(score / softcap)` before the softmax (Gemma 2), with the
  score already scaled, as transformers' eager attention does.
- `sinks`: a float32 `[num_q_heads]` tensor of learned logits (gpt-oss), one per query head, that join
  each softmax's denominator and contribute no value: p_j = exp(s_j - m) / (exp(sink - m) + sum_k
  exp(s_k - m)), m = max(sink, max_k s_k), as transformers' gpt_oss eager attention (the sink as an extra
  logit column, dropped after the softmax). The sink is a logit as it stands: not scaled, not capped.

Written with batched tensor ops (no Python loop over decode sequences) because on the CPU this *is* the
production path. Inputs are checked as the Triton
launchers check them (kernels.checks), except for value checks that would cost an extra pass here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import (
    check_context_fits,
    check_decode,
    check_options,
    check_prefill,
    check_query_layout,
    check_slots,
    check_write_kv,
)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values `[num_tokens, num_kv_heads, head_dim]` into their slots; slot -1 is skipped."""
    check_write_kv("kernels.write_kv_ref", k, v, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        # Checked only here, where padding is present: -1 is padding, anything lower is a bug upstream.
        # (A slot past the cache makes index_copy_ raise.)
        check_slots("kernels.write_kv_ref", int(slots.min()), -1, k_cache)
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if k_cache.dtype == torch.float8_e4m3fn:  # PyTorch has no index_copy_ for float8: copy the bytes
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, num_kv_heads, head_dim] view of each sequence's blocks."""
    tables = block_tables[:, :num_blocks].long()
    gathered = cache.index_select(0, tables.reshape(-1))
    n, bs, h, d = tables.shape[0], cache.shape[1], cache.shape[2], cache.shape[3]
    return gathered.view(n, num_blocks * bs, h, d)


def _readable(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered keys or values SDPA can read: an FP8 cache's e4m3 values widened to the queries' dtype (the
    per-tensor scales are applied by the caller, to the softmax scale and to the output)."""
    return kv.to(dtype) if kv.dtype == torch.float8_e4m3fn else kv


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
            scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Lq, D] over k/v [B, Hk, L, D]; mask broadcastable to [B, Hq, Lq, L] (True: visible)."""
    gqa = k.shape[1] != q.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # transformers' eager attention, op for op: scaled scores, capped, masked, softmax in float32.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    # gpt-oss: the head's sink as one more logit column, in float32 (the sink is float32: rounding it to
    # a bfloat16 query's dtype would move it), softmaxed with the scores and dropped before the values.
    b, h, lq = scores.shape[0], scores.shape[1], scores.shape[2]
    column = sinks.view(1, h, 1, 1).expand(b, h, lq, 1)
    probs = torch.softmax(torch.cat([scores.float(), column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float, *, window: int | None = None, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged context (GQA): `[num_seqs, num_q_heads, head_dim]`."""
    op = "kernels.decode_attention_ref"
    check_decode(op, q, k_cache, v_cache, block_tables, context_lens, scale)
    check_options(op, window, softcap, sinks, q)
    num_seqs, num_q_heads, head_dim = q.shape
    if num_seqs == 0:
        return q.new_empty(q.shape)
    block_size = k_cache.shape[1]
    min_len, max_len = (int(x) for x in torch.aminmax(context_lens))
    check_context_fits(op, min_len, max_len, block_tables, block_size)
    num_blocks = (max_len + block_size - 1) // block_size
    k = _readable(_gather(k_cache, block_tables, num_blocks), q.dtype).transpose(1, 2)  # [S, kvh, L, d]
    v = _readable(_gather(v_cache, block_tables, num_blocks), q.dtype).transpose(1, 2)
    length = k.shape[2]
    positions = torch.arange(length, device=q.device)
    lens = context_lens.to(q.device).long()[:, None]
    mask = positions[None, :] < lens  # [S, L]
    if window is not None:
        mask &= positions[None, :] >= lens - window
    out = _attend(q.unsqueeze(2).to(k.dtype), k, v, mask[:, None, None, :], False, scale, softcap, sinks)
    return out.squeeze(2).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, *, window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked prefill over paged KV: sequence s's last `q_len_s` of `context_lens[s]` positions are new.

    Each new token attends causally to every earlier position of its sequence (cached blocks and the
    chunk itself), whose keys and values are already in the cache.
    Returns `[num_tokens, num_q_heads, head_dim]`.
    """
    op = "kernels.prefill_attention_ref"
    check_prefill(op, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
    check_options(op, window, softcap, sinks, q)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    block_size = k_cache.shape[1]
    check_query_layout(op, starts, lens, q.shape[0])
    if lens:
        check_context_fits(op, min(lens), max(lens), block_tables, block_size, min_allowed=0)
    for s in range(len(lens)):
        q_start, q_end, ctx = starts[s], starts[s + 1], lens[s]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (ctx + block_size - 1) // block_size
        k = _readable(_gather(k_cache, block_tables[s:s + 1], num_blocks)[0, :ctx], q.dtype).transpose(0, 1)
        v = _readable(_gather(v_cache, block_tables[s:s + 1], num_blocks)[0, :ctx], q.dtype).transpose(0, 1)
        qs = q[q_start:q_end].transpose(0, 1).to(k.dtype)  # [h, q_len, d]
        mask, causal = causal_mask(ctx - q_len, q_len, window, q.device)
        # 4-D inputs: PyTorch's CPU flash-attention kernel only takes batched input; 3-D falls back to
        # the unfused math path, several times slower.
        o = _attend(qs[None], k[None], v[None], mask, causal, scale, softcap, sinks)[0]
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def causal_mask(first_pos: int, q_len: int, window: int | None, device) -> tuple[torch.Tensor | None, bool]:
    """(mask [q_len, first_pos + q_len] or None, is_causal) for new tokens at positions first_pos.. that
    see every earlier position, or only the last `window` of them."""
    if first_pos == 0 and window is None:
        return None, True
    ctx = first_pos + q_len
    q_pos = torch.arange(first_pos, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask, False
