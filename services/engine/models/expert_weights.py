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

MXFP4 experts (gpt-oss's `quant_method: mxfp4`: `experts.gate_up_proj_blocks` / `_scales` and the same
for down) are read as they are stored, one packed 4-bit weight per expert and projection
(`QuantizedExperts`), sliced to the rank's rows the same way (down's inputs on whole 32-column blocks).
Other quantized experts and quantized latent attention are refused at load (`check_quantized_experts`).

MLA splits by head (q_b / kv_b rows, o_proj columns); the latent projection is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.layers.mla import deinterleave_rows
from services.engine.models.spec import DecoderSpec, UnsupportedModelError
from services.engine.quant.formats import mxfp4
from services.engine.quant.panel_weight import PanelWeight
from services.engine.quant.projections import QuantizedProjection
from services.engine.quant.scheme import QuantizationConfigError, QuantScheme
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


@dataclass
class QuantizedExperts:
    """One packed weight per expert: `gate_up[e]` `[2I, H]` (gate rows, then up rows), `down[e]` `[H, I]`."""

    gate_up: list[QuantizedProjection]
    down: list[QuantizedProjection]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (*self.gate_up, *self.down))


def check_quantized_experts(spec: DecoderSpec, scheme: QuantScheme | None, gguf: bool) -> None:
    """Refuses, by name, a quantized checkpoint whose expert or latent layers the engine cannot read as stored."""
    if scheme is not None and scheme.method == "mxfp4":
        if spec.moe is None:
            raise QuantizationConfigError("mxfp4", "quant_method", f"MXFP4 quantizes mixture-of-experts layers "
                                                                   f"(gpt-oss's); {spec.architecture} has none")
        if spec.expert_layout.expert_names is not None or spec.mla is not None:
            raise QuantizationConfigError("mxfp4", "quant_method", f"MXFP4 experts are read in gpt-oss's fused "
                                                                   f"layout; {spec.architecture} stores its experts "
                                                                   "one by one")
        return
    if (scheme is not None or gguf) and (spec.moe is not None or spec.mla is not None):
        what = "a GGUF file" if gguf else f"a {scheme.method} checkpoint"
        raise UnsupportedModelError(f"{spec.architecture}: {what} of a mixture-of-experts or latent-attention "
                                    "model is not served (experts are read unquantized or as gpt-oss's MXFP4; "
                                    "latent projections unquantized only)")


def _read_mxfp4(ckpt, b: str, a: int, z: int, first_rank: bool, device: torch.device, put) -> dict:
    """gpt-oss's MXFP4 experts, rows [a, z) of every expert's intermediate size."""
    gu_blocks = ckpt.read_part(b + "experts.gate_up_proj_blocks", (slice(None), slice(2 * a, 2 * z)))
    gu_scales = ckpt.read_part(b + "experts.gate_up_proj_scales", (slice(None), slice(2 * a, 2 * z)))
    if a % mxfp4.BLOCK or z % mxfp4.BLOCK:
        raise TensorParallelConfigError(f"{b}experts.down_proj: MXFP4 blocks of {mxfp4.BLOCK} inputs cannot be split "
                                        f"at rows [{a}, {z}); pick a tensor-parallel size that splits whole blocks")
    cols = (slice(None), slice(None), slice(a // mxfp4.BLOCK, z // mxfp4.BLOCK))
    d_blocks = ckpt.read_part(b + "experts.down_proj_blocks", cols)
    d_scales = ckpt.read_part(b + "experts.down_proj_scales", cols)
    rows = gu_blocks.shape[1]
    # Interleaved rows (gate at even, up at odd) to gate rows then up rows, as the dense layout is held.
    order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])
    gate_up, down = [], []
    for e in range(gu_blocks.shape[0]):
        qw = mxfp4.read_expert(gu_blocks[e], gu_scales[e], f"{b}experts.gate_up_proj[{e}]").take_rows(order)
        gate_up.append(QuantizedProjection(PanelWeight.of(qw, device)))
        down.append(QuantizedProjection(PanelWeight.of(
            mxfp4.read_expert(d_blocks[e], d_scales[e], f"{b}experts.down_proj[{e}]"), device)))
    out = {"experts_gate_up": QuantizedExperts(gate_up, down)}  # holds both projections
    bias = ckpt.read_part(b + "experts.gate_up_proj_bias", (slice(None), slice(2 * a, 2 * z)))
    out["experts_gate_up_bias"] = put(torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
    if first_rank:
        out["experts_down_bias"] = put(ckpt.read(b + "experts.down_proj_bias"))
    return out


def read_moe(ckpt, p: str, spec: DecoderSpec, shard: TensorParallelShard | None, put,
             quantized_on: torch.device | None = None) -> dict:
    """The expert layer's tensors of layer prefix `p` ("layers.{i}."); `quantized_on`: the device of a
    quantized checkpoint's packed weights (MXFP4 experts are read packed where the file stores them so)."""
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
    if names.expert_names is None and b + "experts.gate_up_proj_blocks" in ckpt:
        if quantized_on is None:
            raise QuantizationConfigError("?", "quant_method", f"{b}experts holds MXFP4 blocks but the config has no "
                                                               "quantization_config with quant_method 'mxfp4'")
        return {**out, **_read_mxfp4(ckpt, b, a, z, first_rank, quantized_on, put)}
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
