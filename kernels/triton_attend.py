"""The inner loop both attention kernels share: online softmax over a range of paged KV positions.

A program holds a tile of query rows `q` `[M, BLOCK_D]` (query heads of one KV-head group, and for
prefill several tokens) and walks positions `[n_start, n_end)` of one sequence `TILE_N` at a time. Each
position is gathered through the block table (block id = table[n // BLOCK_SIZE], row n % BLOCK_SIZE), so
a tile may span several KV blocks and the blocks need not be contiguous or unshared. Scores are kept in
log2 units (`qk_scale` already holds scale * log2(e)) so the exponentials are exp2.

Options, compiled in only where used (constexpr switches): a sliding window (a row at position p sees
positions > p - window; callers also start their range at the window), logit soft-capping
(`softcap * tanh(score / softcap)` on the scaled score; `qk_scale` is then the plain scale and the
log2 factor is applied after the cap) and attention sinks (`sink`: each row's sink logit in log2 units,
-inf for none, which joins the denominator and no value: the online softmax starts from it).

Importing this module imports Triton: only the launchers import it, lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_range(q, q_pos, k_head_ptr, v_head_ptr, table_row_ptr, n_start, n_end, qk_scale,
                 stride_kb, stride_kt, stride_vb, stride_vt, ROWS: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 window=0, softcap=0.0, sink=0.0, HAS_WINDOW: tl.constexpr = False,
                 HAS_SOFTCAP: tl.constexpr = False, HAS_SINKS: tl.constexpr = False):
    """Attend `ROWS` query rows to positions [n_start, n_end).

    Returns the unnormalised output `acc` [ROWS, BLOCK_D], the running max `m_i` (log2 units) and the
    softmax denominator `l_i` (0 for a row that saw no position and has no sink).
    """
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    if HAS_SINKS:
        # The sink is a logit seen before any position: the running max starts at it and the denominator
        # at its own term, exp2(sink - sink) = 1 (0 for a row without one, sink -inf). It adds no value.
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for tile_start in range(n_start, n_end, TILE_N):
        n = tile_start + tl.arange(0, TILE_N)
        n_ok = n < n_end
        # 64-bit before multiplying by the block stride: a large cache overflows 32-bit offsets.
        block_id = tl.load(table_row_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = (n % BLOCK_SIZE).to(tl.int64)
        # K is gathered already transposed, [BLOCK_D, TILE_N], so the dot needs no shuffle.
        k_ptrs = k_head_ptr + block_id[None, :] * stride_kb + row[None, :] * stride_kt + d[:, None]
        # .to: an FP8 cache's e4m3 values widened to the queries' type (its scales are applied by the caller)
        k = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            # tanh from one exponential of a non-positive argument: it never overflows.
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(s >= 0, t, -t) * (softcap * 1.4426950408889634)
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps max -inf; shift by 0 instead so exp2 never sees inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = v_head_ptr + block_id[:, None] * stride_vb + row[:, None] * stride_vt + d[None, :]
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
