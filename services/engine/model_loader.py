"""Loads Llama-family weights from a Hugging Face safetensors directory into fused, device-ready tensors,
or draws random ones in a model's real shapes (benchmarks on a machine with no model to download).

Tensors are read one at a time, each from its own short-lived mapping of its file, so the loader's
peak is the model plus one tensor, not the model twice. A tensor-parallel rank reads only its shard
(`TensorParallelShard`): row ranges of Q/K/V, gate/up and the vocabulary, column ranges of o_proj and
down, through safetensors slices, never the whole tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from services.engine.kv_cache_fp8 import read_kv_scales
from services.engine.llama import LlamaConfig, LlamaModel
from services.engine.quant.formats.gguf_tensors import GgufCheckpoint
from services.engine.quant.projections import QuantizedCheckpoint
from services.engine.quant.scheme import check_requested, parse_quantization
from services.engine.tp_shard import TensorParallelShard

if TYPE_CHECKING:
    from services.engine.parallel_state import RankGroup

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}

Range = tuple[int, int] | None  # None: the whole dimension


def read_config(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = set(cfg.get("architectures") or ["LlamaForCausalLM"])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {sorted(archs)}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return cfg


def plan_shard(config: LlamaConfig, group: RankGroup | None) -> TensorParallelShard | None:
    return None if group is None else TensorParallelShard.for_config(config, group.size, group.rank)


class Checkpoint:
    """The tensors of a safetensors directory by name ("model." prefix dropped), read on demand."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {model_dir}")
        self.where: dict[str, tuple[Path, str]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    self.where[name.removeprefix("model.")] = (f, name)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        """The tensor, or only rows [a, b) / columns [a, b) of a matrix (bytes outside are never read)."""
        if name not in self.where:
            raise KeyError(f"weight {name!r} missing from {self.model_dir}")
        path, full = self.where[name]
        with safe_open(str(path), framework="pt") as handle:
            if rows is None and cols is None:
                return handle.get_tensor(full)
            part = handle.get_slice(full)
            if cols is None:
                return part[rows[0]:rows[1]]
            return part[:, cols[0]:cols[1]]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary shard padded with zero rows to the size every rank's shard has."""
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def load_llama(model_dir: str | Path, dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
               group: RankGroup | None = None, quantization: str | None = None,
               gguf: Path | None = None) -> tuple[LlamaModel, dict]:
    """The model (this rank's shard of it when `group` is given) and its Hugging Face config. `gguf`: a GGUF
    file whose weights are read as they are (`model_dir` then holds its config and tokenizer);
    `quantization`: what --quantization asked for (a checkpoint of another kind is refused)."""
    model_dir = Path(model_dir)
    hf_cfg = read_config(model_dir)
    # Refuses, by method and field, what it does not serve. A GGUF file's config was extracted without its
    # quantization_config: its tensors carry their types.
    scheme = None if gguf is not None else parse_quantization(hf_cfg)
    check_requested(scheme, quantization, gguf is not None)
    config = LlamaConfig.from_hf(hf_cfg)
    shard = plan_shard(config, group)
    ckpt = GgufCheckpoint(gguf) if gguf is not None else Checkpoint(model_dir)
    quantized = None if scheme is None and gguf is None else QuantizedCheckpoint(ckpt, scheme, device, dtype)
    whole = shard is None
    q, kv = (None, None) if whole else (shard.q_rows, shard.kv_rows)
    mlp = None if whole else shard.mlp_rows
    vocab = None if whole else shard.vocab_rows

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    def proj(modules: list[str], rows: list[Range] | None = None, cols: Range = None):
        """The modules' weights stacked along their outputs (rows[i] of each, or columns `cols`)."""
        if quantized is not None:
            return quantized.projection(modules, rows, cols)
        rows = rows or [None] * len(modules)
        return put(torch.cat([ckpt.read(m + ".weight", r, cols) for m, r in zip(modules, rows, strict=True)]))

    def qkv_bias(p: str) -> torch.Tensor:
        return torch.cat([ckpt.read(p + "self_attn.q_proj.bias", q), ckpt.read(p + "self_attn.k_proj.bias", kv),
                          ckpt.read(p + "self_attn.v_proj.bias", kv)])

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layer = {
            "input_norm": put(ckpt.read(p + "input_layernorm.weight")),
            "post_norm": put(ckpt.read(p + "post_attention_layernorm.weight")),
            "qkv": proj([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"], [q, kv, kv]),
            "o": proj([p + "self_attn.o_proj"], cols=q),
            "gate_up": proj([p + "mlp.gate_proj", p + "mlp.up_proj"], [mlp, mlp]),
            "down": proj([p + "mlp.down_proj"], cols=mlp),
        }
        if p + "self_attn.q_proj.bias" in ckpt:
            layer["qkv_bias"] = put(qkv_bias(p))
        # A row-parallel layer's bias is added once: by rank 0, before the partial outputs are summed.
        if p + "self_attn.o_proj.bias" in ckpt and (whole or shard.rank == 0):
            layer["o_bias"] = put(ckpt.read(p + "self_attn.o_proj.bias"))
        layers.append(layer)

    def vocab_rows(name: str):
        if quantized is not None:  # a packed LM head (or GGUF's packed token embedding) where the file has one
            return quantized.projection([name.removesuffix(".weight")], [vocab],
                                        pad_rows=None if whole else shard.vocab_shard)
        x = ckpt.read(name, vocab)
        return put(x if whole else _pad_rows(x, shard.vocab_shard))

    embed = vocab_rows("embed_tokens.weight")
    stored_head = any(f"lm_head.{t}" in ckpt for t in ("weight", "qweight", "weight_packed"))
    lm_head = vocab_rows("lm_head.weight") if stored_head and not config.tie_word_embeddings else embed
    weights = {"embed": embed, "layers": layers, "norm": put(ckpt.read("norm.weight")), "lm_head": lm_head}
    model = LlamaModel(config, weights, device, dtype, attention_backend, group, shard)
    model.checkpoint_kv_scales = read_kv_scales(ckpt, config.num_layers)
    return model, hf_cfg


RANDOM_DRAW_DTYPE = "_random_draw_dtype"


def random_llama(hf_cfg: dict, dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
                 seed: int = 0, group: RankGroup | None = None) -> LlamaModel:
    """A Llama of `hf_cfg`'s shapes with random weights drawn on the device (no download, no disk); with
    `group`, this rank's shard's shapes."""
    c = LlamaConfig.from_hf(hf_cfg)
    shard = plan_shard(c, group)
    gen = torch.Generator(device=device).manual_seed(seed + (0 if shard is None else shard.rank))
    # RANDOM_DRAW_DTYPE in the config: draw the values in that dtype, then hold them in `dtype`. A float32
    # model drawn in bfloat16 holds exactly a bfloat16 model's weights (the GPU check's float32 reference).
    draw_name = hf_cfg.get(RANDOM_DRAW_DTYPE)
    draw = getattr(torch, draw_name) if draw_name else dtype

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=draw, device=device).mul_(std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    heads, kv_heads = (c.num_heads, c.num_kv_heads) if shard is None else (shard.num_heads, shard.num_kv_heads)
    inter = c.intermediate_size if shard is None else shard.intermediate
    vocab = c.vocab_size if shard is None else shard.vocab_shard
    qkv_rows = (heads + 2 * kv_heads) * c.head_dim
    layers = [{"input_norm": ones(c.hidden_size), "post_norm": ones(c.hidden_size),
               "qkv": rand(qkv_rows, c.hidden_size), "o": rand(c.hidden_size, heads * c.head_dim),
               "gate_up": rand(2 * inter, c.hidden_size),
               "down": rand(c.hidden_size, inter)} for _ in range(c.num_layers)]
    embed = rand(vocab, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else rand(vocab, c.hidden_size)
    weights = {"embed": embed, "layers": layers, "norm": ones(c.hidden_size), "lm_head": lm_head}
    return LlamaModel(c, weights, device, dtype, attention_backend, group, shard)
