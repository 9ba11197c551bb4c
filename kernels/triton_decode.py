"""Split-KV (flash-decoding) paged attention for one query token per sequence, and its launcher.

Grid (num_seqs, num_kv_heads, num_splits). A program takes every query head of one KV-head group
(grouped-query attention packed into the rows of one dot, so each K/V tile is read once per group, not
once per query head) over one contiguous range of the context. With one split the program normalises
and writes the output itself; with several, each writes a normalised partial output and its log-sum-exp
to float32 scratch, and a second small kernel combines the splits. The split count grows until there
are about two programs per multiprocessor, so a small batch with a long context still fills the GPU.

Attention sinks (gpt-oss) join each (sequence, head)'s softmax exactly once: split 0 starts its online
softmax from the sink, so the sink's mass is in that split's log-sum-exp and the reduce weighs it in
like any position; the other splits start from nothing. With one split the program does the same.

Each sequence divides its own context among the splits (at least `min_split_tokens` per split), on the
device: the grid depends only on host-side numbers (batch size, split count), never on the contents of
`context_lens`. So a caller that knows the longest context (the engine builds it on the host with the
step) launches without any device-to-host read, and a CUDA graph captured for a batch size replays for
any mix of context lengths up to the one it was captured for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels import triton_common
from kernels.checks import check_context_fits, check_decode, check_options, check_strides
from kernels.triton_attend import attend_range
from kernels.triton_common import check_device, check_tile, device_guard, dot_precision, next_pow2, num_sms

OP = "kernels.decode_attention"
LOG2E = 1.4426950408889634
DEFAULT_TILE_N = 64
# Below this many positions per split, the fixed cost of a split (query load, scratch write, reduce)
# outweighs the extra parallelism.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# The reduce kernel's tile covers any split count (masked): one compiled variant, not one per power of two.
REDUCE_SPLITS = next_pow2(MAX_SPLITS)
PROGRAMS_PER_SM = 2


# Arguments that vary from step to step: Triton would otherwise compile a variant for each value equal to 1 or
# divisible by 16 (tests/engine/test_kernel_warmup.py counts the variants over a run of steps).
@triton.jit(do_not_specialize=["num_splits", "stride_table", "window"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, context_lens_ptr,
                         out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
                         qk_scale, num_splits, min_split_tokens, num_q_heads,
                         stride_qs, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh, stride_table, stride_os, stride_oh,
                         window, softcap,
                         QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                         SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # The positions the query sees: all of them, or the last `window` (the splits share only those).
    first = context_len * 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    seen_len = context_len - first
    # This sequence's share per split: whole tiles, never fewer than min_split_tokens positions.
    split_len = tl.cdiv(tl.maximum(tl.cdiv(seen_len, num_splits), min_split_tokens), TILE_N) * TILE_N
    n_start = first + split * split_len
    n_end = tl.minimum(n_start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * QUERIES_PER_KV + g
    row_mask = (g < QUERIES_PER_KV)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)
    if HAS_SINKS:
        # In log2 units, as the scores. Only split 0 carries it, so the reduce counts it once.
        sink = tl.load(sinks_ptr + head, mask=g < QUERIES_PER_KV, other=float("-inf")) * 1.4426950408889634
        if SPLIT:
            sink = tl.where(split == 0, sink, float("-inf"))
    else:
        sink = 0.0

    acc, m_i, l_i = attend_range(q, g, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
                                 tables_ptr + seq * stride_table, n_start, n_end, qk_scale,
                                 stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_G,
                                 BLOCK_SIZE, TILE_N, BLOCK_D, HEAD_DIM, False, DOT_PRECISION,
                                 softcap=softcap, sink=sink, HAS_SOFTCAP=HAS_SOFTCAP, HAS_SINKS=HAS_SINKS)
    # A split past this sequence's end saw nothing (and has no sink: only split 0 does): it writes zeros
    # and lse -inf (weight 0 in the reduce).
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        part_row = (seq * num_q_heads + head) * num_splits + split
        tl.store(part_lse_ptr + part_row, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")),
                 mask=g < QUERIES_PER_KV)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], out, mask=row_mask)
    else:
        out_ptrs = out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, num_q_heads, stride_os, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < num_splits
    part_row = (seq * num_q_heads + head) * num_splits + sp
    lse = tl.load(part_lse_ptr + part_row, mask=sp_ok, other=float("-inf"))
    # Split 0 always holds position 0 (every context has >= 1 token), so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    parts = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :],
                    mask=sp_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight, axis=0)
    out_ptrs = out_ptr + seq * stride_os + head * stride_oh + d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sms: int) -> int:
    """Enough splits for ~PROGRAMS_PER_SM programs per multiprocessor, none shorter than MIN_SPLIT_TOKENS."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * sms // programs)
    return max(1, min(wanted, max_context_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def useful_splits(max_context_len: int, num_splits: int, min_split_tokens: int, tile_n: int) -> int:
    """How many of `num_splits` the longest context fills (the kernel's own division, on the host)."""
    split_len = -(-max(-(-max_context_len // num_splits), min_split_tokens) // tile_n) * tile_n
    return max(1, -(-max_context_len // split_len))


def plan_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                          max_context_len: int | None = None, num_splits: int | None = None,
                          min_split_tokens: int = MIN_SPLIT_TOKENS, tile_n: int = DEFAULT_TILE_N,
                          num_warps: int = 4, num_stages: int | None = None, window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None
                          ) -> Callable[[], torch.Tensor]:
    """Check the inputs, size the grid and allocate; return `run()`, which launches and returns the output.

    `max_context_len`: the longest context, known on the host. Given, the launch reads nothing back
    from the device (no sync, CUDA-graph safe) and the caller vouches for every context being in
    [1, max_context_len]; omitted, it is read from `context_lens` and every length is checked.
    Split from the launch so the benchmark can time the kernels alone; `window`, `softcap` and `sinks`
    as in kernels.reference; the other keyword-only knobs are for tests and the benchmark.
    """
    check_decode(OP, q, k_cache, v_cache, block_tables, context_lens, scale)
    check_options(OP, window, softcap, sinks, q)
    check_device(OP, q)
    check_strides(OP, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                  context_lens=context_lens)
    check_tile(OP, tile_n)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = triton_common.alloc((num_seqs, num_q_heads, head_dim), q.dtype, q.device)
    if out.numel() == 0:
        return lambda: out
    if max_context_len is None:
        # Without host-side metadata: one host read for the longest context and both ends' checks.
        min_len, max_len = torch.stack([context_lens.min(), context_lens.max()]).tolist()
    else:
        min_len, max_len = 1, int(max_context_len)
    check_context_fits(OP, min_len, max_len, block_tables, block_size)
    if min_split_tokens < 1:
        raise ValueError(f"{OP}: min_split_tokens must be >= 1, got {min_split_tokens}")

    seen_max = max_len if window is None else min(max_len, window)  # positions one query sees at most
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, seen_max, num_sms(q.device))
    num_splits = useful_splits(seen_max, num_splits, min_split_tokens, tile_n)
    split = num_splits > 1
    if split:
        part_out = triton_common.alloc((num_seqs, num_q_heads, num_splits, head_dim), torch.float32, q.device)
        part_lse = triton_common.alloc((num_seqs, num_q_heads, num_splits), torch.float32, q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when SPLIT is off
    queries_per_kv = num_q_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    extra = {} if num_stages is None else {"num_stages": num_stages}

    def run() -> torch.Tensor:
        with device_guard(q):
            _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
                # Without sinks q stands in for their pointer, never read (HAS_SINKS off).
                q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
                q if sinks is None else sinks,
                float(scale) * (1.0 if softcap else LOG2E), num_splits, min_split_tokens, num_q_heads,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                out.stride(0), out.stride(1), window or 0, float(softcap or 0.0),
                QUERIES_PER_KV=queries_per_kv, BLOCK_G=max(16, next_pow2(queries_per_kv)), HEAD_DIM=head_dim,
                BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE_N=tile_n, SPLIT=split,
                DOT_PRECISION=dot_precision(q.dtype), HAS_WINDOW=window is not None,
                HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, num_warps=num_warps, **extra,
            )
            if split:
                _decode_reduce_kernel[(num_seqs, num_q_heads)](
                    part_out, part_lse, out, num_splits, num_q_heads, out.stride(0), out.stride(1),
                    HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=max(REDUCE_SPLITS, next_pow2(num_splits)),
                    num_warps=4,
                )
        return out

    return run


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     **knobs) -> torch.Tensor:
    """Triton twin of `decode_attention_ref` (knobs: see `plan_decode_attention`)."""
    return plan_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, **knobs)()
