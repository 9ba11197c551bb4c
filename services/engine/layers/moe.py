"""The mixture-of-experts layer: a router choosing `top_k` experts per token, the experts' gated MLPs run
once per active expert over the tokens routed to it, and the results combined with the routing weights.

Routing is data (`MoeSpec.routing`), applied with transformers' arithmetic so float32 outputs stay
bit-comparable with it:
- `softmax_topk` (Mixtral, Qwen3-MoE): softmax over every expert's logit in float32, the top k, then
  renormalised over them when `norm_topk_prob` (Mixtral always).
- `topk_softmax` (gpt-oss): the top k logits (the router has a bias), softmax over those k only.
- `sigmoid_group` (DeepSeek-V3): sigmoid scores in float32; the choice adds `e_score_correction_bias`
  and is limited to the `topk_group` best of `n_group` groups (each group scored by its two best
  experts); the weights are the chosen experts' scores without the bias, renormalised when
  `norm_topk_prob`, times `routed_scaling_factor`.

The experts themselves go through the fused expert kernels (kernels/moe_*.py): tokens grouped by expert
once per layer call, one GEMM pair per active expert (the CPU path, on the dense layers' bf16 GEMM) or
two grouped Triton launches (CUDA, vLLM's fused_moe technique).
Shared experts (DeepSeek) are a plain gated MLP added to the routed output.

Tensor parallelism splits every expert like a dense MLP (each rank holds a slice of every expert's
intermediate rows; the output is all-reduced by the decoder as a dense MLP's is), see `ExpertLayer`.
Per-expert token counts are accumulated for the scheduler's Prometheus metric (`expert_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.layers.activations import gated

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_group")
EXPERT_ACTIVATIONS = ("silu", "gpt_oss_swiglu")  # kernels.moe_reference.moe_activation's names


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's intermediate rows
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # gpt-oss
    score_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    router_float32: bool = False  # DeepSeek-V3: the router's weight and product in float32
    activation: str = "silu"
    expert_bias: bool = False  # gpt-oss: gate_up and down biases per expert
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # DeepSeek-V3's shared experts, one gated MLP (0: none)

    def __post_init__(self):
        """ValueError naming the config's field where the routing cannot be what it asks for."""
        assert self.routing in ROUTINGS, self.routing
        assert self.activation in EXPERT_ACTIVATIONS, self.activation
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"config field num_experts_per_tok={self.top_k} is not within 1..{self.num_experts} "
                             "experts")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size {self.intermediate_size} is not positive")
        if self.routing == "sigmoid_group":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"config field n_group={self.n_group} does not divide {self.num_experts} experts")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"config field topk_group={self.topk_group} is not within 1..n_group={self.n_group}")
            if self.top_k > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(f"config field num_experts_per_tok={self.top_k} exceeds the experts of "
                                 f"topk_group={self.topk_group} groups")
            if self.num_experts // self.n_group < 2:
                raise ValueError(f"config field n_group={self.n_group} leaves fewer than 2 experts per group (each "
                                 "group is scored by its two best)")


def route(logits: torch.Tensor, spec: MoeSpec, correction: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, K] int64, topk_weights [T, K]) from the router's logits [T, E]."""
    k = spec.top_k
    if spec.routing == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
    if spec.routing == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(top, dim=1, dtype=top.dtype)
    scores = logits.float().sigmoid()
    choice = scores if correction is None else scores + correction
    T, E, G = scores.shape[0], spec.num_experts, spec.n_group
    group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * spec.routed_scaling_factor


class ExpertLayer:
    """One MoE layer's weights (this rank's slice of every expert) and its forward.

    `w["router"]` [E, H] (+ `router_bias` [E], `correction` [E]); `w["experts_gate_up"]` [E, 2I, H] (gate
    rows, then up rows), `w["experts_down"]` [E, H, I], optional `experts_gate_up_bias` [E, 2I] and
    `experts_down_bias` [E, H] (held by rank 0 only under tensor parallelism, as a row-parallel bias
    is); the shared experts' `shared_gate_up` [2S, H] and `shared_down` [H, S] as plain linears.

    On the CPU the experts are packed once for the dense layers' GEMM (kernels.pack_experts_cpu) and run
    by kernels.fused_experts_cpu (quantized experts as one quantized linear per expert,
    kernels.linear_experts_cpu); with `triton` (the Triton attention backend: CUDA, or the interpreter) by
    the Triton grouped kernel (kernels.fused_experts).
    """

    __slots__ = ("spec", "router", "router_bias", "correction", "gate_up", "down", "gate_up_bias", "down_bias",
                 "packed", "shared_gate_up", "shared_down", "expert_tokens")

    def __init__(self, w: dict, spec: MoeSpec, linear, triton: bool = False):
        import kernels

        self.spec = spec
        self.router = w["router"].float() if spec.router_float32 else w["router"]
        self.router_bias = w.get("router_bias")
        self.correction = w.get("correction")
        gate_up, down = w["experts_gate_up"], w.get("experts_down")
        gate_up_bias, down_bias = w.get("experts_gate_up_bias"), w.get("experts_down_bias")
        self.packed = None
        if hasattr(gate_up, "gate_up"):
            # Quantized experts (MXFP4, models/expert_weights.QuantizedExperts): one quantized linear per expert
            # and projection, on the CPU path (the decoder refuses them where the Triton kernel would run).
            assert not triton
            n = len(gate_up.gate_up)
            pick = (lambda b, e: None if b is None else b[e])
            self.packed = kernels.linear_experts_cpu(
                [linear(gate_up.gate_up[e], pick(gate_up_bias, e)) for e in range(n)],
                [linear(gate_up.down[e], pick(down_bias, e)) for e in range(n)],
                gate_up.down[0].out_features, gate_up.gate_up[0].out_features // 2, w["router"].dtype)
            gate_up = down = gate_up_bias = down_bias = None
        elif not triton:  # the CPU path: only the packed copy is kept
            self.packed = kernels.pack_experts_cpu(gate_up, down, gate_up_bias, down_bias)
            gate_up = down = gate_up_bias = down_bias = None
        self.gate_up, self.down, self.gate_up_bias, self.down_bias = gate_up, down, gate_up_bias, down_bias
        self.shared_gate_up = linear(w["shared_gate_up"]) if "shared_gate_up" in w else None
        self.shared_down = linear(w["shared_down"]) if "shared_down" in w else None
        # Tokens routed to each expert since the last read (the metrics' per-expert counter), on the device.
        self.expert_tokens = torch.zeros(spec.num_experts, dtype=torch.int64, device=w["router"].device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import kernels

        spec = self.spec
        if spec.router_float32:
            logits = F.linear(x.float(), self.router)
        else:
            logits = F.linear(x, self.router, self.router_bias)
        ids, weights = route(logits, spec, self.correction)
        self.expert_tokens += torch.bincount(ids.flatten(), minlength=spec.num_experts)
        options = dict(alpha=spec.swiglu_alpha, limit=spec.swiglu_limit, ids_checked=True)
        if self.packed is not None:
            out = kernels.fused_experts_cpu(x, None, None, ids, weights, spec.activation, packed=self.packed,
                                            **options)
        else:
            out = kernels.fused_experts(x, self.gate_up, self.down, ids, weights, spec.activation,
                                        b_gate_up=self.gate_up_bias, b_down=self.down_bias, **options)
        if self.shared_gate_up is not None:
            out = out + self.shared_down(gated("silu", self.shared_gate_up(x)))
        return out
