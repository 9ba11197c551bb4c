"""The fused expert (mixture-of-experts) computation's specification: the PyTorch reference, the gated
activations, and the argument checks every MoE entry point shares.

Layouts (every MoE entry point: this reference, kernels.moe_cpu, kernels.triton_fused_moe):

- x `[T, H]`, float32 / float16 / bfloat16;
- w_gate_up `[E, 2I, H]`: expert e's gate rows first, then its up rows, so gate = x @ w_gate_up[e, :I].T
  and up = x @ w_gate_up[e, I:].T (transformers' MixtralExperts layout; gpt-oss checkpoints interleave
  gate and up columns and the loader de-interleaves them);
- w_down `[E, H, I]`: down = h @ w_down[e].T;
- topk_ids `[T, K]` int32/int64, every id in [0, E) (a token may name one expert in several slots: each
  slot counts); topk_weights `[T, K]`, any float dtype, applied in float32;
- optional biases b_gate_up `[E, 2I]` (gate then up, like the rows) and b_down `[E, H]`; the down bias
  is added before the routing weight scales the row (gpt-oss).

out[t] = sum_k topk_weights[t, k] * (down_e(act(gate_e(x_t), up_e(x_t))) + b_down[e]), e = topk_ids[t, k].

Roundings (what the fast paths are held to): each projection's output is rounded to x's dtype, the
activation runs in x's dtype in transformers' op order, the weighted rows are summed in float32 and the
sum rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, _tensor

ACTIVATIONS = ("silu", "gpt_oss_swiglu")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", *,
                   alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """The gated activation of one expert's rows, in the inputs' dtype.

    "silu": silu(gate) * up (Llama/Mixtral/Qwen MoE). "gpt_oss_swiglu": transformers' GptOssExperts
    arithmetic, op for op: gate clamped above at `limit`, up clamped to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate).
    """
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gpt_oss_swiglu":
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        return (up + 1) * glu
    raise ValueError(f"unknown MoE activation {activation!r}; expected one of {ACTIVATIONS}")


def check_routing(op: str, x, topk_ids, topk_weights, activation: str, num_experts: int, *,
                  check_ids: bool = True) -> None:
    """topk_ids / topk_weights against x and E, and the activation's name; with `check_ids`, the ids'
    range too (the one check that reads values: a host read, a sync on CUDA)."""
    _tensor(op, "topk_ids", topk_ids, 2, INDEX_DTYPES)
    _tensor(op, "topk_weights", topk_weights, 2, FLOAT_DTYPES)
    if topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: topk_ids and topk_weights must both be [T={x.shape[0]}, K]; got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}; got {activation!r}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise TypeError(f"{op}: all tensors must be on one device; got x on {x.device}, {name} on {t.device}")
    if check_ids and topk_ids.numel():
        low, high = (int(v) for v in torch.aminmax(topk_ids))
        if low < 0 or high >= num_experts:
            raise ValueError(f"{op}: topk_ids must lie in [0, {num_experts}); got ids from {low} to {high}")


def check_moe_args(op: str, x, w_gate_up, w_down, topk_ids, topk_weights, activation: str,
                   b_gate_up=None, b_down=None, *, check_ids: bool = True) -> tuple[int, int, int, int, int]:
    """Structure (metadata only) and, with `check_ids`, the expert ids' range (one host read).

    Returns (T, H, E, I, K). Raises TypeError (type, dtype, device) or ValueError (shape, value) naming
    the entry point and the argument.
    """
    _tensor(op, "x", x, 2, FLOAT_DTYPES)
    _tensor(op, "w_gate_up", w_gate_up, 3, (x.dtype,))
    _tensor(op, "w_down", w_down, 3, (x.dtype,))
    tokens, hidden = x.shape
    experts, two_i, w_hidden = w_gate_up.shape
    if two_i % 2 or w_hidden != hidden:
        raise ValueError(f"{op}: w_gate_up must be [E, 2I, H={hidden}]; got {tuple(w_gate_up.shape)}")
    inter = two_i // 2
    if tuple(w_down.shape) != (experts, hidden, inter):
        raise ValueError(f"{op}: w_down must be [E={experts}, H={hidden}, I={inter}]; got {tuple(w_down.shape)}")
    if b_gate_up is not None:
        _tensor(op, "b_gate_up", b_gate_up, 2, FLOAT_DTYPES)
        if tuple(b_gate_up.shape) != (experts, two_i):
            raise ValueError(f"{op}: b_gate_up must be [E={experts}, 2I={two_i}]; got {tuple(b_gate_up.shape)}")
    if b_down is not None:
        _tensor(op, "b_down", b_down, 2, FLOAT_DTYPES)
        if tuple(b_down.shape) != (experts, hidden):
            raise ValueError(f"{op}: b_down must be [E={experts}, H={hidden}]; got {tuple(b_down.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down), ("b_gate_up", b_gate_up), ("b_down", b_down)):
        if t is not None and t.device != x.device:
            raise TypeError(f"{op}: all tensors must be on one device; got x on {x.device}, {name} on {t.device}")
    check_routing(op, x, topk_ids, topk_weights, activation, experts, check_ids=check_ids)
    return tokens, hidden, experts, inter, topk_ids.shape[1]


def _bias(b: torch.Tensor | None, e: int, rows: slice | None = None) -> torch.Tensor | None:
    if b is None:
        return None
    return b[e] if rows is None else b[e, rows]


def fused_experts_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, activation: str = "silu", *, b_gate_up: torch.Tensor | None = None,
                      b_down: torch.Tensor | None = None, alpha: float = GPT_OSS_ALPHA,
                      limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """`[T, H]` in x's dtype: every token through its top-k experts, weighted and summed (module docstring).

    The slow, obviously correct definition: a loop over all E experts; each finds its (token, slot)
    pairs with a comparison, projects those tokens' rows (gate and up as two separate products), applies
    the activation, projects down, and adds the routing-weighted rows into a float32 sum.
    """
    op = "kernels.fused_experts_ref"
    tokens, hidden, experts, inter, _ = check_moe_args(op, x, w_gate_up, w_down, topk_ids, topk_weights, activation,
                                                       b_gate_up, b_down)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    gate_rows, up_rows = slice(0, inter), slice(inter, 2 * inter)
    for e in range(experts):
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        xs = x.index_select(0, token)
        b_gate = _bias(b_gate_up, e, gate_rows)
        b_up = _bias(b_gate_up, e, up_rows)
        gate = F.linear(xs, w_gate_up[e, gate_rows], None if b_gate is None else b_gate.to(x.dtype))
        up = F.linear(xs, w_gate_up[e, up_rows], None if b_up is None else b_up.to(x.dtype))
        h = moe_activation(gate, up, activation, alpha=alpha, limit=limit)
        b_e = _bias(b_down, e)
        y = F.linear(h, w_down[e], None if b_e is None else b_e.to(x.dtype))
        out.index_put_((token,), y.float() * topk_weights[token, slot].float()[:, None], accumulate=True)
    return out.to(x.dtype)
