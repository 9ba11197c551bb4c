"""The fused expert computation on the CPU: group a layer call's (token, slot) pairs by expert once, then
run each active expert as two GEMMs over all its tokens; and the packing of expert weights once at load.

Work is proportional to the pairs routed, never to E: an expert no token chose costs nothing but a
skipped count, and there is no per-token Python loop (per active expert: one gather of its tokens' rows,
the gate_up GEMM, the activation, the down GEMM, one scaled scatter-add into a float32 sum).

Which GEMM (so MoE experts go the dense linears' way, services/engine/linear.py):

- bfloat16 with weights packed by `pack_experts_cpu` (the engine's case): `kernels.cpu.bf16_gemm_choice()`,
  the dense layers' rule: pagedserve's AVX512-BF16 GEMM over per-expert panels packed once (CPUs with
  AVX512-BF16 and no AMX in use), as one `bf16_grouped_gemm` call per projection for all active experts
  (their weights stream past the cores in one parallel region, instead of a call and a thread wake-up per
  expert; at decode an expert has 1-3 rows, so the layer is bound by reading its weights), else oneDNN
  over weights reordered once (`torch.ops.mkldnn._linear_pointwise`, what the dense PackedLinear calls;
  AMX machines);
- float16 packed: oneDNN reordered weights, as the dense layers;
- float32, or any dtype unpacked: `F.linear` (oneDNN/MKL underneath; float32 results match transformers,
  as the dense float32 Linear does). Unpacked bfloat16 works but oneDNN reorders each weight per call.
- quantized experts (gpt-oss's MXFP4): `linear_experts_cpu` takes one callable per expert and projection
  (the engine's quantized linears, which dequantize inside the C++ GEMM), bias included.

The SiLU activation in half precision takes the C++ `silu_mul` the dense MLP uses (float32 inside, one
rounding); float32 and gpt-oss's activation run kernels.moe_reference.moe_activation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.checks import _tensor
from kernels.moe_align import ExpertGroups, group_by_expert
from kernels.moe_reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_moe_args, check_routing, moe_activation

log = logging.getLogger(__name__)
GEMM_KINDS = ("avx512", "onednn", "linear")
CALLABLE = "callable"  # linear_experts_cpu: per-expert callables


@dataclass(frozen=True)
class CpuExperts:
    """Expert weights in the form one GEMM kind reads, built once (pack_experts_cpu).

    `gate_up[e]` / `down[e]` are expert e's operands: bf16_gemm panels (a stacked tensor, "avx512"),
    oneDNN-reordered weights (a list, "onednn"), the plain `[2I, H]` / `[H, I]` rows ("linear"), or
    callables computing `x @ w.T + b` ("callable", biases inside them).
    Biases are in the form that GEMM adds them: float32 padded to whole panels ("avx512"), the weight's
    dtype otherwise; None without biases.
    """

    kind: str
    dtype: torch.dtype
    num_experts: int
    hidden: int
    inter: int
    gate_up: object
    down: object
    b_gate_up: object = None
    b_down: object = None
    mod: object = None  # the C++ extension ("avx512")


def _padded_bias(b: torch.Tensor, panel_cols: int) -> torch.Tensor:
    # bf16_gemm adds a float32 bias before its one rounding, padded to the packed panels' width.
    out = torch.zeros(b.shape[0], panel_cols, dtype=torch.float32)
    out[:, :b.shape[1]] = b.float()
    return out


def _plain(w_gate_up, w_down, b_gate_up, b_down) -> CpuExperts:
    dtype = w_gate_up.dtype
    return CpuExperts("linear", dtype, w_gate_up.shape[0], w_gate_up.shape[2], w_gate_up.shape[1] // 2, w_gate_up,
                      w_down, None if b_gate_up is None else b_gate_up.to(dtype),
                      None if b_down is None else b_down.to(dtype))


def linear_experts_cpu(gate_up: list, down: list, hidden: int, inter: int, dtype: torch.dtype) -> CpuExperts:
    """Experts whose projections are callables (`gate_up[e](x)`: `[n, H] -> [n, 2I]`, gate columns then up;
    `down[e](h)`: `[n, I] -> [n, H]`, biases included), e.g. quantized linears that dequantize inside their
    GEMM. Pass the result as `fused_experts_cpu(..., packed=...)`."""
    if len(gate_up) != len(down) or not gate_up or not all(map(callable, (*gate_up, *down))):
        raise ValueError("kernels.linear_experts_cpu: one gate_up and one down callable per expert")
    return CpuExperts(CALLABLE, dtype, len(gate_up), hidden, inter, list(gate_up), list(down))


def pack_experts_cpu(w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                     b_down: torch.Tensor | None = None, *, gemm: str = "auto", batch_hint: int = 64) -> CpuExperts:
    """Expert weights (layouts: kernels.moe_reference) in the form the CPU GEMM reads, once, at load.

    `gemm`: "auto" (the dense linears' choice for the dtype, module docstring), or force "avx512"
    (bfloat16 only, needs an AVX512-BF16 build), "onednn" (half precision) or "linear" (no packing).
    `batch_hint`: the row count oneDNN tunes its reorder for. The result replaces the weights: pass it as
    `fused_experts_cpu(..., packed=...)`, with w_gate_up and w_down None so only the packed copy is kept.
    """
    op = "kernels.pack_experts_cpu"
    if gemm not in ("auto", *GEMM_KINDS):
        raise ValueError(f"{op}: gemm must be auto or one of {GEMM_KINDS}; got {gemm!r}")
    _tensor(op, "w_gate_up", w_gate_up, 3, (torch.float32, torch.float16, torch.bfloat16))
    _tensor(op, "w_down", w_down, 3, (w_gate_up.dtype,))
    experts, two_i, hidden = w_gate_up.shape
    if two_i % 2 or tuple(w_down.shape) != (experts, hidden, two_i // 2):
        raise ValueError(f"{op}: expected w_gate_up [E, 2I, H] and w_down [E, H, I]; got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if w_gate_up.device.type != "cpu":
        raise TypeError(f"{op}: CPU weights only; got {w_gate_up.device}")
    dtype = w_gate_up.dtype
    if gemm == "auto" and dtype == torch.bfloat16:
        from kernels.cpu import bf16_gemm_choice

        gemm = bf16_gemm_choice()
    elif gemm == "auto":
        gemm = "onednn" if dtype == torch.float16 else "linear"
    if gemm == "avx512":
        from kernels.cpu import load

        mod = load()
        if dtype != torch.bfloat16 or mod is None or not mod.bf16_gemm_supported():
            raise ValueError(f"{op}: gemm='avx512' needs bfloat16 weights and an AVX512-BF16 build of kernels.cpu")
        gate_up = torch.stack([mod.bf16_gemm_pack(w_gate_up[e].contiguous()) for e in range(experts)])
        down = torch.stack([mod.bf16_gemm_pack(w_down[e].contiguous()) for e in range(experts)])
        return CpuExperts(
            "avx512", dtype, experts, hidden, two_i // 2, gate_up, down,
            None if b_gate_up is None else _padded_bias(b_gate_up, gate_up.shape[1] * gate_up.shape[3]),
            None if b_down is None else _padded_bias(b_down, down.shape[1] * down.shape[3]), mod)
    if gemm == "onednn" and dtype != torch.float32:
        try:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            gate_up = [reorder(w_gate_up[e].contiguous(), batch_hint) for e in range(experts)]
            down = [reorder(w_down[e].contiguous(), batch_hint) for e in range(experts)]
        except Exception as e:  # an older torch, or a CPU without oneDNN's half-precision path
            log.info("oneDNN weight packing unavailable for the experts (%s); using F.linear", e)
        else:
            return CpuExperts("onednn", dtype, experts, hidden, two_i // 2, gate_up, down,
                              None if b_gate_up is None else b_gate_up.to(dtype).contiguous(),
                              None if b_down is None else b_down.to(dtype).contiguous())
    return _plain(w_gate_up, w_down, b_gate_up, b_down)


def _gemm(experts: CpuExperts, x: torch.Tensor, w, out_features: int, bias) -> torch.Tensor:
    """x @ w.T (+ bias) for one expert's operand `w` (module-level so tests can count the calls)."""
    if experts.kind == CALLABLE:
        return w(x)
    if experts.kind == "avx512":
        return experts.mod.bf16_gemm(x, w, out_features, bias)
    if experts.kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")
    return F.linear(x, w, bias)


def _expert_forward(experts: CpuExperts, e: int, xs: torch.Tensor, activation: str, alpha: float, limit: float,
                    fused) -> torch.Tensor:
    """Expert e on its tokens' rows `xs [n, H]`: down(act(gate, up)) + b_down, in x's dtype."""
    inter = experts.inter
    pick = (lambda b: None if b is None else b[e])
    gate_up = _gemm(experts, xs, experts.gate_up[e], 2 * inter, pick(experts.b_gate_up))
    if fused is not None:
        h = fused.silu_mul(gate_up)
    else:
        h = moe_activation(gate_up[:, :inter], gate_up[:, inter:], activation, alpha=alpha, limit=limit)
    return _gemm(experts, h, experts.down[e], experts.hidden, pick(experts.b_down))


def _grouped(experts: CpuExperts) -> bool:
    """Whether one bf16_grouped_gemm call per projection can run the layer (pagedserve's AVX512-BF16 panels,
    even K on both GEMMs, a build that has it)."""
    return (experts.kind == "avx512" and experts.hidden % 2 == 0 and experts.inter % 2 == 0
            and hasattr(experts.mod, "bf16_grouped_gemm"))


def _grouped_forward(experts: CpuExperts, xs: torch.Tensor, offsets: torch.Tensor, activation: str, alpha: float,
                     limit: float, fused) -> torch.Tensor:
    """Every active expert at once: the rows `xs` grouped by expert (`offsets`), one grouped GEMM per
    projection and the activation over all rows; each row bit-identical to `_expert_forward`'s."""
    inter, mod = experts.inter, experts.mod
    gate_up = mod.bf16_grouped_gemm(xs, experts.gate_up, offsets, 2 * inter, experts.b_gate_up)
    if fused is not None:
        h = fused.silu_mul(gate_up)
    else:
        h = moe_activation(gate_up[:, :inter], gate_up[:, inter:], activation, alpha=alpha, limit=limit)
    return mod.bf16_grouped_gemm(h.contiguous(), experts.down, offsets, experts.hidden, experts.b_down)


def fused_experts_cpu(x: torch.Tensor, w_gate_up: torch.Tensor | None, w_down: torch.Tensor | None,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str = "silu", *,
                      b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                      alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT, packed: CpuExperts | None = None,
                      groups: ExpertGroups | None = None, ids_checked: bool = False) -> torch.Tensor:
    """kernels.moe_reference.fused_experts_ref's result, `[T, H]` in x's dtype, computed per active expert.

    `packed`: pack_experts_cpu's result (the weights and biases it holds are used: pass w_gate_up,
    w_down as None, or the tensors it was packed from, and no biases). `groups`: this call's
    group_by_expert(topk_ids, E) if the caller already has it. `ids_checked`: the caller checked that every
    id lies in [0, E); skips the one read of their range (an id outside it would make the grouping raise).
    """
    op = "kernels.fused_experts_cpu"
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":
        raise TypeError(f"{op} runs on CPU tensors; got x on {x.device} (kernels.fused_experts runs Triton)")
    if packed is None:
        check_moe_args(op, x, w_gate_up, w_down, topk_ids, topk_weights, activation, b_gate_up, b_down,
                       check_ids=not ids_checked)
        experts = _plain(w_gate_up, w_down, b_gate_up, b_down)
    else:
        if b_gate_up is not None or b_down is not None:
            raise ValueError(f"{op}: with packed weights the biases are the packed ones; pass b_gate_up/b_down "
                             f"to pack_experts_cpu")
        _tensor(op, "x", x, 2, (packed.dtype,))
        if x.shape[1] != packed.hidden:
            raise ValueError(f"{op}: x must be [T, H={packed.hidden}] for these experts; got {tuple(x.shape)}")
        check_routing(op, x, topk_ids, topk_weights, activation, packed.num_experts, check_ids=not ids_checked)
        experts = packed
    tokens = x.shape[0]
    if groups is None:
        groups = group_by_expert(topk_ids, experts.num_experts)
    # Routing weights in the grouped order, float32, once for all experts.
    weights = topk_weights.reshape(-1).index_select(0, groups.sorted_ids).float()
    out = torch.zeros(tokens, experts.hidden, dtype=torch.float32)
    fused = None
    if activation == "silu" and x.dtype != torch.float32:
        from kernels.cpu import load

        fused = load()  # None without a compiler: moe_activation then
    # One gather of every pair's row in the grouped order; each expert then reads a contiguous slice of it,
    # and its outputs are concatenated back in the same order: per active expert only the two GEMMs and
    # the activation run (a decode step of a 64-expert model has ~50 active experts per layer, so every
    # per-expert op saved is ~50 small torch calls per layer).
    xs = x.index_select(0, groups.token_ids)
    if _grouped(experts):
        y = _grouped_forward(experts, xs, groups.offsets, activation, alpha, limit, fused)
    else:  # the per-expert calls read the counts on the host (the grouped GEMM reads the offsets itself)
        counts, offsets = groups.counts.tolist(), groups.offsets.tolist()
        ys = [_expert_forward(experts, e, xs.narrow(0, offsets[e], n), activation, alpha, limit, fused)
              for e, n in enumerate(counts) if n]
        y = (ys[0] if len(ys) == 1 else torch.cat(ys)) if ys else xs
    # index_put_(accumulate=True) is index_add_'s scatter-add (repeated rows summed: a token naming one
    # expert in two slots), in the pairs' order, so a token's experts are summed in expert order as the
    # per-expert loop (and transformers) summed them; it runs on one thread where index_add_ opens a
    # parallel region (60 ms a call on this 2-core machine while another process ran). y is this call's own
    # product (float() returns it as is for float32 x), so it is scaled in place.
    out.index_put_((groups.token_ids,), y.float().mul_(weights.unsqueeze(1)), accumulate=True)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
