"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed latent per token.

Per token and layer the cache holds `kv_lora_rank` latent values (the RMS-normalised output of
`kv_a_proj_with_mqa`) and the `qk_rope_head_dim` rotated key values shared by every head: one "KV head"
of `kv_lora_rank + qk_rope_head_dim` values (576 for DeepSeek-V3, against 2 x 128 x 192 = 49,152 for the
expanded keys and values), in the same paged blocks, prefix cache and preemption as any layer.

Attention runs in latent space, with the up-projections absorbed (DeepSeek's and vLLM's decode form):
head h's key is `W_UK[h] c` and its value `W_UV[h] c` for the latent c, so its score is
`(W_UK[h]^T q_nope) . c + q_rope . k_rope` and its output `W_UV[h] (sum_j p_j c_j)`. The query becomes
`[W_UK[h]^T q_nope, q_rope]` and the attention is multi-query attention over the cached entries with
head dim `kv_lora_rank + qk_rope_head_dim`, whose values are the same entries: the backends read one
cache tensor as both keys and values (the last `qk_rope_head_dim` output values are dropped). Every
backend (C++, Triton, references) runs it unchanged, prefill, chunked prefill and decode alike; the
scores equal the expanded form's up to float rounding.

DeepSeek stores the rotary dimensions interleaved (`rope_interleave`, pairs (x0, x1), (x2, x3), ...):
the loader permutes those weight rows to the half-split order the rotary layer uses, which gives
transformers' interleaved rotation exactly (it de-interleaves before rotating).

Tensor parallel: heads are split (q_b / kv_b rows, o_proj columns); the latent projection and the cache
are replicated on every rank (one KV head, replicated as tensor_parallel.py replicates KV heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.layers.norms import RMSNorm

LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MlaSpec:
    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def expanded_dim(self, num_heads: int) -> int:
        """Values per token and layer of the expanded keys and values (what a plain cache would hold)."""
        return num_heads * (self.qk_head_dim + self.v_head_dim)


def deinterleave_rows(w: torch.Tensor, starts: list[int], n: int) -> torch.Tensor:
    """w with each run of rows [start, start + n) (rotary pairs interleaved) reordered evens then odds."""
    perm = torch.arange(w.shape[0])
    half = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
    for start in starts:
        perm[start:start + n] = half + start
    return w.index_select(0, perm)


class MlaAttention:
    """One layer's latent attention. Weights: `q` [heads * qk_head_dim, hidden] or `q_a` [q_lora, hidden] +
    `q_a_norm` + `q_b` [heads * qk_head_dim, q_lora]; `kv_a` [kv_lora + rope, hidden] + `kv_a_norm`;
    `kv_b` [heads * (nope + v), kv_lora]; `o` [hidden, heads * v]. Rope rows already de-interleaved."""

    __slots__ = ("spec", "heads", "q", "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "w_uk", "w_uv", "o")

    def __init__(self, w: dict, spec: MlaSpec, heads: int, linear):
        self.spec, self.heads = spec, heads
        self.q = linear(w["q"]) if "q" in w else None
        self.q_a = linear(w["q_a"]) if "q_a" in w else None
        # transformers builds these two norms with its default epsilon (1e-6), not the config's rms_norm_eps.
        eps = LATENT_NORM_EPS
        self.q_a_norm = RMSNorm(w["q_a_norm"], eps) if "q_a_norm" in w else None
        self.q_b = linear(w["q_b"]) if "q_b" in w else None
        self.kv_a, self.kv_a_norm = linear(w["kv_a"]), RMSNorm(w["kv_a_norm"], eps)
        kv_b = w["kv_b"].view(heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        # Absorbed up-projections: [heads, nope, r] for the query, [heads, r, v] for the output.
        self.w_uk = kv_b[:, :spec.qk_nope_head_dim].contiguous()
        self.w_uv = kv_b[:, spec.qk_nope_head_dim:].transpose(1, 2).contiguous()
        self.o = linear(w["o"])

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rope, attend) -> torch.Tensor:
        """x [T, hidden] -> the attention output before o_proj's reduce, [T, hidden]. `attend(q, kv)`: the
        paged attention with q [T, heads, cache_dim] and kv [T, 1, cache_dim] (written as keys and values)."""
        s, T, H = self.spec, x.shape[0], self.heads
        r, nope = s.kv_lora_rank, s.qk_nope_head_dim
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = q.view(T, H, s.qk_head_dim)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        latent, k_rope = self.kv_a(x).split((r, s.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_norm(latent.contiguous())
        q_rope, k_rope = rope(positions, q_rope.contiguous(), k_rope.reshape(T, 1, s.qk_rope_head_dim))
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        query = torch.cat([q_latent, q_rope], dim=-1)
        kv = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)
        out = attend(query, kv)[..., :r]  # [T, H, r]: the probability-weighted latents per head
        out = torch.einsum("thr,hrv->thv", out, self.w_uv).reshape(T, H * s.v_head_dim)
        return self.o(out)

