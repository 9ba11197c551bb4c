"""The fused expert computation on CUDA (or the CPU under TRITON_INTERPRET=1): a grouped GEMM kernel over
tiles of one expert each, and the launcher that runs a MoE layer with it (vLLM's fused_moe technique).

One layer call: the (token, slot) pairs are sorted by expert and each expert's run padded to a multiple
of BLOCK_M (kernels.moe_align.align_block_size), so every tile of BLOCK_M rows belongs to one expert.
Launch 1 multiplies each tile's token rows of x by its expert's gate_up rows into `[T*K, 2I]` (row = flat
pair id); the activation (torch, kernels.moe_reference.moe_activation) makes `[T*K, I]`; launch 2
multiplies those rows by the expert's down rows, adds the down bias, scales by the routing weight and
writes `[T*K, H]`; the K slots of each token are then summed in float32. Padding rows carry an id no
pair has and are masked on every load and store; tiles past the used rows (the grid is sized by the
worst case, the used count is read on the device) return at once, so nothing is read back to the host
and a launch can be captured in a CUDA graph.

Products accumulate in float32; float32 inputs use IEEE dots (not TF32), 16-bit inputs tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_align import BlockAlignment, align_block_size
from kernels.moe_reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_moe_args, moe_activation
from kernels.triton_common import alloc, check_device, device_guard, dot_precision, interpreting, next_pow2

OP = "kernels.fused_experts"


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_gemm_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, block_experts_ptr,
                         num_padded_ptr, N, K, num_rows, a_row_div, stride_am, stride_we, stride_wn, stride_wk,
                         stride_be, stride_cm, HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """C[id] = A[id // a_row_div] @ W[e].T (+ bias[e]) (* topk_weights[id]) for the ids of tile pid_m, whose
    expert is e, over columns pid_n * BLOCK_N ...; W[e] is [N, K] read through its strides."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a tile past the rows this call's routing uses
    e = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < num_rows  # padding rows hold num_rows
    ids = tl.where(valid, ids, 0).to(tl.int64)
    a_rows = ids // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e * stride_be + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        # gpt-oss adds the down bias before the routing weight scales the row: so does this order.
        acc *= tl.load(topk_weights_ptr + ids, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + ids[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def default_block_m(num_rows: int, num_experts: int) -> int:
    """Tile height: small tiles while experts get few rows each (decode), so padding wastes little."""
    if interpreting():
        return 16
    per_expert = num_rows / max(1, num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _block(size: int, cap: int) -> int:
    # tl.dot needs every tile dimension >= 16 (and a power of two for tl.arange).
    return max(16, min(cap, next_pow2(size)))


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  topk_weights: torch.Tensor | None, align: BlockAlignment, a_row_div: int) -> None:
    n, k = w.shape[1], w.shape[2]
    cap_n, cap_k = (32, 32) if interpreting() else (64, 64)
    block_n, block_k = _block(n, cap_n), _block(k, cap_k)
    grid = (align.max_blocks, triton.cdiv(n, block_n))
    if grid[0] == 0:
        return
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, topk_weights if topk_weights is not None else out,
        align.sorted_ids, align.block_experts, align.num_padded, n, k, align.num_rows, a_row_div, a.stride(0),
        w.stride(0), w.stride(1), w.stride(2), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION=dot_precision(a.dtype), BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4)


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, activation: str = "silu", *, b_gate_up: torch.Tensor | None = None,
                  b_down: torch.Tensor | None = None, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT,
                  alignment: BlockAlignment | None = None, ids_checked: bool = False) -> torch.Tensor:
    """kernels.moe_reference.fused_experts_ref's result, `[T, H]` in x's dtype, by two grouped GEMM launches.

    `alignment`: this call's align_block_size(topk_ids, E, block_m) if the caller made it (any block_m
    >= 16, a power of two). `ids_checked`: the caller checked that every id lies in [0, E); otherwise the
    launcher reads their range once (a host sync on CUDA).
    """
    check_device(OP, x)
    tokens, hidden, experts, inter, top_k = check_moe_args(OP, x, w_gate_up, w_down, topk_ids, topk_weights,
                                                           activation, b_gate_up, b_down, check_ids=not ids_checked)
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError(f"{OP}: x, w_gate_up and w_down need stride 1 in their last dimension")
    num_rows = tokens * top_k
    if alignment is None:
        alignment = align_block_size(topk_ids, experts, default_block_m(num_rows, experts))
    elif alignment.num_rows != num_rows or alignment.block_m < 16 or alignment.block_m & (alignment.block_m - 1):
        raise ValueError(f"{OP}: alignment made for {alignment.num_rows} pairs with block_m {alignment.block_m}; "
                         f"this call has {num_rows} pairs and needs block_m a power of two >= 16")
    # Flat pair id t * K + k indexes the routing weights directly.
    weights = topk_weights.to(torch.float32).contiguous()
    gate_up = alloc((num_rows, 2 * inter), x.dtype, x.device)
    down = alloc((num_rows, hidden), x.dtype, x.device)
    with device_guard(x):
        _grouped_gemm(x, w_gate_up, b_gate_up, gate_up, None, alignment, top_k)
        h = moe_activation(gate_up[:, :inter], gate_up[:, inter:], activation, alpha=alpha, limit=limit)
        _grouped_gemm(h, w_down, b_down, down, weights, alignment, 1)
    return down.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
