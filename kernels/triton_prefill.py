"""Chunked-prefill paged attention (any number of new tokens per sequence, decode included), and its launcher.

Grid (num_seqs, query tiles, num_kv_heads). A program's rows are BLOCK_Q new tokens times the query
heads of one KV-head group (row r: token r // BLOCK_G, head r % BLOCK_G), so K/V tiles are read once per
group. Sequence s's new tokens are its last q_len_s positions: token i sits at position
context_len - q_len + i and sees positions 0..itself, cached blocks and the chunk alike (its own keys
and values are already in the cache). A program stops at the last position its newest token sees.
A decode token is the case q_len = 1; the split-KV decode kernel is faster for that, because here a
long context is never split across programs. Attention sinks start each row's online softmax (its
query head's sink, kernels.triton_attend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels import triton_common
from kernels.checks import check_context_fits, check_options, check_prefill, check_query_layout, check_strides
from kernels.triton_attend import attend_range
from kernels.triton_common import check_device, check_tile, device_guard, dot_precision, next_pow2, num_sms

OP = "kernels.prefill_attention"
LOG2E = 1.4426950408889634
DEFAULT_TILE_N = 64


# The block-table width varies from step to step: no variant per value divisible by 16 or equal to 1.
@triton.jit(do_not_specialize=["stride_table", "window"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, query_start_loc_ptr, context_lens_ptr,
                    out_ptr, sinks_ptr, qk_scale,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_table, stride_ot, stride_oh, window, softcap,
                    QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk
        return
    context_len = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    token = q_tile * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    head = kv_head * QUERIES_PER_KV + g
    row_mask = ((token < q_len) & (g < QUERIES_PER_KV))[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask, other=0.0)
    q_pos = context_len - q_len + token
    if HAS_SINKS:  # each row's query head's sink, in log2 units as the scores
        sink = tl.load(sinks_ptr + head, mask=g < QUERIES_PER_KV, other=float("-inf")) * 1.4426950408889634
    else:
        sink = 0.0
    # The tile's newest token is the last position any row here sees.
    n_end = tl.minimum(context_len, context_len - q_len + (q_tile + 1) * BLOCK_Q)
    # With a window, the tile's oldest token sees nothing before its own window.
    n_start = context_len * 0
    if HAS_WINDOW:
        n_start = tl.maximum(context_len - q_len + q_tile * BLOCK_Q - window + 1, 0)

    acc, _, l_i = attend_range(q, q_pos, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
                               tables_ptr + seq * stride_table, n_start, n_end, qk_scale,
                               stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_Q * BLOCK_G,
                               BLOCK_SIZE, TILE_N, BLOCK_D, HEAD_DIM, True, DOT_PRECISION,
                               window=window, softcap=softcap, sink=sink, HAS_WINDOW=HAS_WINDOW,
                               HAS_SOFTCAP=HAS_SOFTCAP, HAS_SINKS=HAS_SINKS)
    # Every valid row sees at least position 0, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def choose_block_m(num_seqs: int, max_q_len: int, num_kv_heads: int, block_g: int, sms: int) -> int:
    """Rows per program: 128 while that still gives every multiprocessor a program, else 64."""
    programs = num_seqs * triton.cdiv(max_q_len, max(1, 128 // block_g)) * num_kv_heads
    return 128 if programs >= sms else 64


def plan_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
                           max_context_len: int | None = None, block_m: int | None = None,
                           tile_n: int = DEFAULT_TILE_N, num_warps: int | None = None,
                           num_stages: int | None = None, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None
                           ) -> Callable[[], torch.Tensor]:
    """Check the inputs, size the grid and allocate; return `run()`, which launches and returns the output.

    `max_query_len` and `max_context_len`: the longest chunk and context, known on the host. Given
    both, the launch reads nothing back from the device and the caller vouches for the layout
    (query_start_loc running 0..num_tokens, no chunk longer than its context); omitted, the offsets and
    lengths are read once and checked. Split from the launch so the benchmark can time the kernel
    alone; `window`, `softcap` and `sinks` as in kernels.reference; the other keyword-only knobs are for
    tests and the benchmark.
    """
    check_prefill(OP, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
    check_options(OP, window, softcap, sinks, q)
    check_device(OP, q)
    check_strides(OP, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                  query_start_loc=query_start_loc, context_lens=context_lens)
    check_tile(OP, tile_n)
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"{OP}: block_m must be a power of two >= 16, got {block_m}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    out = triton_common.alloc((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if max_query_len is None or max_context_len is None:
        # Without host-side metadata: one host read; the grid needs the longest chunk, the checks every offset.
        host = torch.cat([query_start_loc.long(), context_lens.long()]).tolist()
        starts, lens = host[:num_seqs + 1], host[num_seqs + 1:]
        check_query_layout(OP, starts, lens, num_tokens)
        if num_seqs:
            check_context_fits(OP, min(lens), max(lens), block_tables, block_size, min_allowed=0)
        max_q_len = max((b - a for a, b in zip(starts[:-1], starts[1:], strict=True)), default=0)
    else:
        max_q_len = int(max_query_len)
        if num_seqs:
            check_context_fits(OP, 0, int(max_context_len), block_tables, block_size, min_allowed=0)
    if out.numel() == 0 or max_q_len == 0:
        return lambda: out

    queries_per_kv = num_q_heads // num_kv_heads
    block_g = next_pow2(queries_per_kv)
    if block_m is None:
        block_m = choose_block_m(num_seqs, max_q_len, num_kv_heads, block_g, num_sms(q.device))
    block_q = max(1, block_m // block_g)
    block_d = max(16, next_pow2(head_dim))
    if num_warps is None:
        # A 128 x 128 float32 accumulator is 128 registers a thread over 4 warps: spread it over 8.
        num_warps = 8 if block_q * block_g * block_d >= 128 * 128 else 4
    extra = {} if num_stages is None else {"num_stages": num_stages}
    grid = (num_seqs, triton.cdiv(max_q_len, block_q), num_kv_heads)

    def run() -> torch.Tensor:
        with device_guard(q):
            _prefill_kernel[grid](
                # Without sinks q stands in for their pointer, never read (HAS_SINKS off).
                q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
                q if sinks is None else sinks, float(scale) * (1.0 if softcap else LOG2E),
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                out.stride(0), out.stride(1), window or 0, float(softcap or 0.0),
                QUERIES_PER_KV=queries_per_kv, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=head_dim,
                BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tile_n,
                DOT_PRECISION=dot_precision(q.dtype), HAS_WINDOW=window is not None,
                HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, num_warps=num_warps, **extra,
            )
        return out

    return run


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                      scale: float, **knobs) -> torch.Tensor:
    """Triton twin of `prefill_attention_ref` (knobs: see `plan_prefill_attention`)."""
    return plan_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                  **knobs)()
