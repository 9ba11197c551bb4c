"""The reference configuration the default-path guard measures the engine against: a tiny Llama's
forward over each recorded step, in plain PyTorch on dense per-sequence keys and values.

No paging, no step validation, no packed weights, no fused kernels, no sampler beyond a greedy argmax:
the least an engine computes for a step. It is a yardstick for CPU time, measured in the same process
and run as the engine on the same steps, not a specification of the engine's outputs (its weights are
its own random ones).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.contracts.step_protocol import SchedulerOutput


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class DenseReference:
    def __init__(self, hf_cfg: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.hidden = hf_cfg["hidden_size"]
        self.heads = hf_cfg["num_attention_heads"]
        self.kv_heads = hf_cfg.get("num_key_value_heads", self.heads)
        self.head_dim = hf_cfg.get("head_dim") or self.hidden // self.heads
        self.eps = hf_cfg.get("rms_norm_eps", 1e-5)
        inter, vocab = hf_cfg["intermediate_size"], hf_cfg["vocab_size"]
        q_rows = (self.heads + 2 * self.kv_heads) * self.head_dim

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=g) * 0.02).to(dtype)

        self.embed = rand(vocab, self.hidden)
        self.layers = [{"qkv": rand(q_rows, self.hidden), "o": rand(self.hidden, self.heads * self.head_dim),
                        "gate_up": rand(2 * inter, self.hidden), "down": rand(self.hidden, inter),
                        "norm1": torch.ones(self.hidden, dtype=dtype), "norm2": torch.ones(self.hidden, dtype=dtype)}
                       for _ in range(hf_cfg["num_hidden_layers"])]
        self.norm = torch.ones(self.hidden, dtype=dtype)
        half = self.head_dim // 2
        inv = 1.0 / (hf_cfg.get("rope_theta", 10000.0) ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(hf_cfg["max_position_embeddings"], dtype=torch.float32), inv)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    @torch.inference_mode()
    def step(self, out: SchedulerOutput) -> list[int]:
        """One step's forward; returns the greedy token of every sampling row."""
        seqs = out.sequences
        ids = torch.tensor([t for s in seqs for t in s.token_ids])
        positions = torch.tensor([s.start_pos + j for s in seqs for j in range(len(s.token_ids))])
        bounds, start = [], 0
        for s in seqs:
            bounds.append((start, start + len(s.token_ids)))
            start += len(s.token_ids)
        T, D = ids.shape[0], self.head_dim
        h = F.embedding(ids, self.embed)
        for li, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["norm1"], self.eps)
            q, k, v = F.linear(x, layer["qkv"]).split(
                (self.heads * D, self.kv_heads * D, self.kv_heads * D), dim=-1)
            q = self._rope(q.view(T, self.heads, D), positions)
            k = self._rope(k.view(T, self.kv_heads, D), positions)
            v = v.view(T, self.kv_heads, D)
            o = torch.empty_like(q)
            for s, (a, b) in zip(seqs, bounds, strict=True):
                cache = self.kv.setdefault(s.seq_id, [])
                if len(cache) <= li:
                    # A prefix-cache hit: the reference keeps no shared blocks, zeros stand for the prefix.
                    pad = k.new_zeros((s.start_pos, self.kv_heads, D))
                    cache.append((torch.cat((pad, k[a:b])), torch.cat((pad, v[a:b]))))
                else:
                    ck, cv = cache[li]
                    cache[li] = (torch.cat((ck[:s.start_pos], k[a:b])), torch.cat((cv[:s.start_pos], v[a:b])))
                keys, values = cache[li]
                ctx, n = keys.shape[0], b - a
                mask = None if n == 1 else (torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None])
                o[a:b] = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                    enable_gqa=self.kv_heads != self.heads).transpose(0, 1)
            h = h + F.linear(o.reshape(T, -1), layer["o"])
            gate, up = F.linear(_rms_norm(h, layer["norm2"], self.eps), layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"])
        rows = torch.tensor([b - 1 for s, (_, b) in zip(seqs, bounds, strict=True) if s.sample], dtype=torch.long)
        logits = F.linear(_rms_norm(h.index_select(0, rows), self.norm, self.eps), self.embed)
        return logits.argmax(-1).tolist()
