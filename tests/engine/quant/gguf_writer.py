"""A small GGUF file written here: SmolLM2's tokenizer and metadata, a tiny Llama's shapes, random blocks of
each served ggml type (valid float16 scales, every code value), mixed within one model so that one file
exercises every type and the unfused path (Q, K and V of different types)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from services.bench.offline.quant_formats import copy_gguf_metadata
from services.model_files.model_source import default_gguf_path

BLOCK = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q8_0: (32, 34), Q.Q4_K: (256, 144), Q.Q5_K: (256, 176),
         Q.Q6_K: (256, 210)}


def random_blocks(kind: Q, rows: int, k: int, gen: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, bytes per row] of `kind` with random codes and small positive float16 scales."""
    per, size = BLOCK[kind]
    n = rows * (k // per)
    b = gen.integers(0, 256, size=(n, size), dtype=np.uint8)

    def f16(values):
        return np.asarray(values, dtype=np.float16).reshape(n, 1).view(np.uint8)

    if kind in (Q.Q4_0, Q.Q8_0):
        b[:, 0:2] = f16(gen.uniform(0.5, 1.5, n) * scale * (8 if kind == Q.Q4_0 else 1) / 8)
    elif kind == Q.Q4_1:
        b[:, 0:2] = f16(gen.uniform(0.5, 1.5, n) * scale)
        b[:, 2:4] = f16(-gen.uniform(0.5, 1.5, n) * scale * 8)
    elif kind in (Q.Q4_K, Q.Q5_K):
        b[:, 0:2] = f16(gen.uniform(0.5, 1.5, n) * scale / 32)
        b[:, 2:4] = f16(gen.uniform(0.5, 1.5, n) * scale / 4)
    else:  # Q6_K: d last, int8 scales
        b[:, 208:210] = f16(gen.uniform(0.5, 1.5, n) * scale / 64)
    return b.reshape(rows, -1)


def write_tiny_gguf(path: Path, types: dict[str, Q], hidden=256, inter=512, layers=2, heads=4, kv_heads=2,
                    seed=0) -> Path:
    """`types`: ggml type per tensor role (token_embd, attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
    ffn_down); a layer's roles rotate through the types by layer index for variety."""
    src = gguf.GGUFReader(str(default_gguf_path()))
    w = gguf.GGUFWriter(str(path), "llama")
    sizes = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": inter,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
             "llama.rope.dimension_count": hidden // heads, "llama.context_length": 2048}
    copy_gguf_metadata(src, w, sizes)
    gen = np.random.default_rng(seed)
    vocab = 49152
    roles = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden // heads * kv_heads, hidden),
              "attn_v": (hidden // heads * kv_heads, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}

    def add(name, kind, rows, k):
        if kind == Q.F32:
            w.add_tensor(name, gen.normal(1.0, 0.1, size=(rows, k) if k else rows).astype(np.float32))
        else:
            w.add_tensor(name, random_blocks(kind, rows, k, gen), raw_dtype=kind)

    add("token_embd.weight", types["token_embd"], vocab, hidden)
    kinds = [types[r] for r in roles]
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", Q.F32, hidden, 0)
        add(f"blk.{i}.ffn_norm.weight", Q.F32, hidden, 0)
        for j, role in enumerate(roles):
            add(f"blk.{i}.{role}.weight", kinds[(j + i) % len(kinds)], *shapes[role])
    add("output_norm.weight", Q.F32, hidden, 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantize_reference(kind: Q, raw: np.ndarray) -> torch.Tensor:
    """The gguf package's own dequantizer (the oracle the decoders are held to)."""
    return torch.from_numpy(gguf.dequantize(raw, kind).astype(np.float32))
