"""Reads a layer's mixture-of-experts block and its latent attention (MLA) from a checkpoint, as the
checkpoint stores them, into the tensors `layers/moe.py` and `layers/mla.py` hold; this rank's shard.

Experts are read per expert ("experts.{e}.gate_proj" / "w1", Mixtral and Qwen3-MoE and DeepSeek-V3) or
as fused 3-D tensors (gpt-oss's "experts.gate_up_proj" [E, hidden, 2I] with gate and up columns
interleaved, "experts.down_proj" [E, I, hidden]) and held as `[E, 2I, hidden]` (gate rows, then up
rows) and `[E, hidden, I]`, the layout the fused expert kernels take: no conversion step on disk.

Tensor parallel: every expert is split like a dense MLP, rank r holding intermediate rows
[r*I/N, (r+1)*I/N) of every expert (gate/up column-parallel, down row-parallel); the router is
replicated. Why not expert parallelism: a rank holding whole experts idles when routing favours
another rank's experts (the imbalance users of the anchors report), and it needs an all-to-all of
tokens per layer; split like a dense MLP, every rank does the same share of every active expert's work
and the layer ends in the same one all-reduce a dense MLP has. The price is narrower GEMMs per rank,
which at the expert sizes of today's models (I = 768 .. 2,048) still fill a CPU's or GPU's tiles.

MLA splits by head (q_b / kv_b rows, o_proj columns); the latent projection is replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.engine.layers.mla import deinterleave_rows
from services.engine.models.spec import DecoderSpec
from services.engine.tp_shard import TensorParallelConfigError

if TYPE_CHECKING:
    from services.engine.tp_shard import TensorParallelShard


def expert_rows(intermediate: int, shard: TensorParallelShard | None) -> tuple[int, int]:
    """The intermediate rows of every expert this rank holds."""
    if shard is None:
        return 0, intermediate
    if intermediate % shard.size:
        raise TensorParallelConfigError(f"tensor_parallel_size {shard.size} does not divide the experts' "
                                        f"intermediate size {intermediate}")
    n = intermediate // shard.size
    return shard.rank * n, (shard.rank + 1) * n


def read_moe(ckpt, p: str, spec: DecoderSpec, shard: TensorParallelShard | None, put) -> dict:
    """The expert layer's tensors of layer prefix `p` ("layers.{i}.")."""
    moe, names = spec.moe, spec.expert_layout
    first_rank = shard is None or shard.rank == 0
    b = p + names.block + "."
    router = b + names.router + "."
    out = {"router": put(ckpt.read(router + "weight"))}
    if moe.router_float32:  # DeepSeek keeps the router (and its correction bias) in float32
        out["router"] = ckpt.read(router + "weight").to(device=out["router"].device, dtype=torch.float32)
    if moe.router_bias:
        out["router_bias"] = put(ckpt.read(router + "bias"))
    if moe.score_correction_bias:
        out["correction"] = ckpt.read(router + "e_score_correction_bias").to(out["router"].device, torch.float32)
    a, z = expert_rows(moe.intermediate_size, shard)
    E = moe.num_experts
    if names.expert_names is None:
        gate_up = ckpt.read_part(b + "experts.gate_up_proj", (slice(None), slice(None), slice(2 * a, 2 * z)))
        # Interleaved columns (gate at even, up at odd) to gate rows then up rows.
        out["experts_gate_up"] = put(torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=2).transpose(1, 2))
        out["experts_down"] = put(ckpt.read_part(b + "experts.down_proj", (slice(None), slice(a, z))).transpose(1, 2))
        if moe.expert_bias:
            bias = ckpt.read_part(b + "experts.gate_up_proj_bias", (slice(None), slice(2 * a, 2 * z)))
            out["experts_gate_up_bias"] = put(torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
            if first_rank:  # a row-parallel bias is added once, before the partial outputs are summed
                out["experts_down_bias"] = put(ckpt.read(b + "experts.down_proj_bias"))
        return out
    g, u, d = names.expert_names
    gate_up, down = [], []
    for e in range(E):
        x = b + f"experts.{e}."
        gate_up.append(torch.cat([ckpt.read(x + f"{g}.weight", (a, z)), ckpt.read(x + f"{u}.weight", (a, z))]))
        down.append(ckpt.read(x + f"{d}.weight", cols=(a, z)))
    out["experts_gate_up"], out["experts_down"] = put(torch.stack(gate_up)), put(torch.stack(down))
    if names.shared is not None:
        s = b + names.shared + "."
        sa, sz = expert_rows(moe.shared_intermediate_size, shard)
        out["shared_gate_up"] = put(torch.cat([ckpt.read(s + "gate_proj.weight", (sa, sz)),
                                               ckpt.read(s + "up_proj.weight", (sa, sz))]))
        out["shared_down"] = put(ckpt.read(s + "down_proj.weight", cols=(sa, sz)))
    return out


def read_mla(ckpt, p: str, spec: DecoderSpec, shard: TensorParallelShard | None, put) -> dict:
    """The latent attention's tensors of layer prefix `p`, this rank's heads."""
    m = spec.mla
    h0, nh = (0, spec.num_heads) if shard is None else (shard.head_start, shard.num_heads)
    a = p + "self_attn."
    qk = m.qk_head_dim

    def rope_rows(w: torch.Tensor, per_head: int, offset: int) -> torch.Tensor:
        if not m.rope_interleave:
            return w
        starts = [h * per_head + offset for h in range(w.shape[0] // per_head)]
        return deinterleave_rows(w, starts, m.qk_rope_head_dim)

    out = {}
    q_rows = (h0 * qk, (h0 + nh) * qk)
    if m.q_lora_rank is None:
        out["q"] = put(rope_rows(ckpt.read(a + "q_proj.weight", q_rows), qk, m.qk_nope_head_dim))
    else:
        out["q_a"] = put(ckpt.read(a + "q_a_proj.weight"))
        out["q_a_norm"] = put(ckpt.read(a + "q_a_layernorm.weight"))
        out["q_b"] = put(rope_rows(ckpt.read(a + "q_b_proj.weight", q_rows), qk, m.qk_nope_head_dim))
    kv_a = ckpt.read(a + "kv_a_proj_with_mqa.weight")
    out["kv_a"] = put(deinterleave_rows(kv_a, [m.kv_lora_rank], m.qk_rope_head_dim) if m.rope_interleave else kv_a)
    out["kv_a_norm"] = put(ckpt.read(a + "kv_a_layernorm.weight"))
    per = m.qk_nope_head_dim + m.v_head_dim
    out["kv_b"] = put(ckpt.read(a + "kv_b_proj.weight", (h0 * per, (h0 + nh) * per)))
    out["o"] = put(ckpt.read(a + "o_proj.weight", cols=(h0 * m.v_head_dim, (h0 + nh) * m.v_head_dim)))
    return out
