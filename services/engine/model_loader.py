"""Loads a model from a Hugging Face safetensors directory into fused, device-ready tensors, or draws
random ones in a model's real shapes (benchmarks on a machine with no model to download).

Which code runs it is the registry's choice (services/engine/models/registry.py): a family module's
`DecoderSpec`, whose checkpoint names are mapped here onto the decoder's fused tensors (separate or
already fused Q/K/V and gate/up, biases, the family's norms), or the transformers backend.

Tensors are read one at a time, each from its own short-lived mapping of its file, so the loader's
peak is the model plus one tensor, not the model twice. A tensor-parallel rank reads only its shard
(`TensorParallelShard`): row ranges of Q/K/V, gate/up and the vocabulary, column ranges of o_proj and
down, through safetensors slices, never the whole tensor; a checkpoint that stores Q/K/V or gate/up
fused (Phi-3) is read as the same ranges of the fused tensor.

A quantized checkpoint (services/engine/quant: FP8, compressed-tensors, GPTQ/AWQ, or a GGUF file read
as it is) gives its projections as packed weights, sliced by the same ranges; norms, biases and
embeddings stay plain unless the file stores them packed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from services.engine.kv_cache_fp8 import read_kv_scales
from services.engine.layers.rotary import rope_note
from services.engine.models.decoder import DecoderModel
from services.engine.models.expert_weights import check_quantized_experts, read_mla, read_moe
from services.engine.models.registry import MODULE_PATH, ModelChoice, choose_model, read_spec
from services.engine.models.spec import DecoderSpec, UnsupportedModelError
from services.engine.quant.formats.gguf_tensors import GgufCheckpoint
from services.engine.quant.projections import QuantizedCheckpoint
from services.engine.quant.scheme import check_requested, parse_quantization
from services.engine.tp_shard import TensorParallelShard

if TYPE_CHECKING:
    from services.engine.parallel_state import RankGroup

log = logging.getLogger(__name__)

Range = tuple[int, int] | None  # None: the whole dimension


def read_config(model_dir: Path) -> dict:
    """config.json, checked: an architecture and fields the engine serves exactly (else a clear error)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    choose_model(cfg)
    return cfg


def model_spec(hf_cfg: dict) -> DecoderSpec:
    """The DecoderSpec of a config a family module serves (what the TP plan and LoRA read)."""
    choice = choose_model(hf_cfg)
    if choice.path != MODULE_PATH:
        raise UnsupportedModelError(f"{choice.architecture} runs on the transformers path, which has no tensor "
                                    "parallelism and no LoRA adapters: serve it on one rank without adapters")
    return read_spec(choice)


def plan_shard(config, group: RankGroup | None) -> TensorParallelShard | None:
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

    def read_part(self, name: str, index: tuple) -> torch.Tensor:
        """A slice of a tensor of any rank, e.g. (slice(None), slice(a, b)) (bytes outside are never read)."""
        if name not in self.where:
            raise KeyError(f"weight {name!r} missing from {self.model_dir}")
        path, full = self.where[name]
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_slice(full)[index]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary shard padded with zero rows to the size every rank's shard has."""
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


class _LayerReader:
    """Reads one family's layer tensors, this rank's shard of them, as the decoder's fused roles."""

    def __init__(self, spec: DecoderSpec, ckpt, shard: TensorParallelShard | None, put,
                 quantized: QuantizedCheckpoint | None = None):
        self.spec, self.ckpt, self.shard, self.put, self.quantized = spec, ckpt, shard, put, quantized
        c = spec
        q_all, kv_all = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_all, self.kv_all = q_all, kv_all
        whole = shard is None
        self.q = (0, q_all) if whole else shard.q_rows
        self.kv = (0, kv_all) if whole else shard.kv_rows
        self.mlp = (0, c.intermediate_size) if whole else shard.mlp_rows
        self.first_rank = whole or shard.rank == 0

    def qkv(self, p: str, kind: str) -> torch.Tensor:
        read = self.ckpt.read
        if self.spec.layout.fused_qkv:
            name = p + f"self_attn.qkv_proj.{kind}"
            return torch.cat([read(name, self.q), read(name, _shift(self.kv, self.q_all)),
                              read(name, _shift(self.kv, self.q_all + self.kv_all))])
        return torch.cat([read(p + f"self_attn.q_proj.{kind}", self.q), read(p + f"self_attn.k_proj.{kind}", self.kv),
                          read(p + f"self_attn.v_proj.{kind}", self.kv)])

    def gate_up(self, p: str, kind: str) -> torch.Tensor:
        read = self.ckpt.read
        if self.spec.layout.fused_gate_up:
            name = p + f"mlp.gate_up_proj.{kind}"
            return torch.cat([read(name, self.mlp), read(name, _shift(self.mlp, self.spec.intermediate_size))])
        return torch.cat([read(p + f"mlp.gate_proj.{kind}", self.mlp), read(p + f"mlp.up_proj.{kind}", self.mlp)])

    def _packed(self, p: str, mlp: bool = True) -> dict:
        """The four projections of a quantized checkpoint (Q/K/V and O only where `mlp` is False: an expert
        layer's place), as the quantization layer holds them."""
        q, spec = self.quantized, self.spec
        whole = self.shard is None
        q_rows, kv_rows, mlp_rows = (None, None, None) if whole else (self.q, self.kv, self.mlp)
        if spec.layout.fused_qkv:
            qkv = q.projection([p + "self_attn.qkv_proj"] * 3,
                               [self.q, _shift(self.kv, self.q_all), _shift(self.kv, self.q_all + self.kv_all)])
        else:
            qkv = q.projection([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
                               [q_rows, kv_rows, kv_rows])
        out = {"qkv": qkv, "o": q.projection([p + "self_attn.o_proj"], cols=q_rows)}
        if not mlp:
            return out
        if spec.layout.fused_gate_up:
            gate_up = q.projection([p + "mlp.gate_up_proj"] * 2,
                                   [self.mlp, _shift(self.mlp, spec.intermediate_size)])
        else:
            gate_up = q.projection([p + "mlp.gate_proj", p + "mlp.up_proj"], [mlp_rows, mlp_rows])
        return {**out, "gate_up": gate_up, "down": q.projection([p + "mlp.down_proj"], cols=mlp_rows)}

    def layer(self, i: int) -> dict:
        spec, read, put = self.spec, self.ckpt.read, self.put
        p = f"layers.{i}."
        out = {role: put(read(p + name + ".weight")) for role, name in spec.layout.norms}
        if spec.qk_norm:
            out["q_norm"] = put(read(p + "self_attn.q_norm.weight"))
            out["k_norm"] = put(read(p + "self_attn.k_norm.weight"))
        if self.quantized is not None:
            out.update(self._packed(p, mlp=i not in spec.moe_layers))
            if i in spec.moe_layers:  # MXFP4 (check_quantized_experts): its experts, the rest as stored
                out.update(read_moe(self.ckpt, p, spec, self.shard, put, self.quantized.device))
        else:
            if spec.mla is not None:
                out.update(read_mla(self.ckpt, p, spec, self.shard, put))
            else:
                out.update(qkv=put(self.qkv(p, "weight")), o=put(read(p + "self_attn.o_proj.weight", cols=self.q)))
            if i in spec.moe_layers:
                out.update(read_moe(self.ckpt, p, spec, self.shard, put))
            else:
                out.update(gate_up=put(self.gate_up(p, "weight")),
                           down=put(read(p + "mlp.down_proj.weight", cols=self.mlp)))
        if spec.attention_sinks:  # per query head, kept in float32 as the kernels read them
            heads = (0, spec.num_heads) if self.shard is None else (
                self.shard.head_start, self.shard.head_start + self.shard.num_heads)
            out["sinks"] = read(p + "self_attn.sinks", heads).to(device=out["input_norm"].device, dtype=torch.float32)
        if spec.qkv_bias:
            out["qkv_bias"] = put(self.qkv(p, "bias"))
        if spec.mlp_bias and i not in spec.moe_layers:
            out["gate_up_bias"] = put(self.gate_up(p, "bias"))
        # A row-parallel layer's bias is added once: by rank 0, before the partial outputs are summed.
        if self.first_rank:
            if spec.o_bias:
                out["o_bias"] = put(read(p + "self_attn.o_proj.bias"))
            if spec.mlp_bias and i not in spec.moe_layers:
                out["down_bias"] = put(read(p + "mlp.down_proj.bias"))
        return out


def load_decoder(choice: ModelChoice, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 attention_backend: str = "auto", group: RankGroup | None = None,
                 max_model_len: int | None = None, scheme=None, gguf: Path | None = None) -> DecoderModel:
    """`scheme`: the checkpoint's quantization (services/engine/quant/scheme.py); `gguf`: a GGUF file whose
    weights are read as they are."""
    spec = read_spec(choice)
    shard = plan_shard(spec, group)
    ckpt = GgufCheckpoint(gguf) if gguf is not None else Checkpoint(model_dir)
    quantized = None if scheme is None and gguf is None else QuantizedCheckpoint(ckpt, scheme, device, dtype)
    check_quantized_experts(spec, scheme, gguf is not None)
    whole = shard is None

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    reader = _LayerReader(spec, ckpt, shard, put, quantized)
    layers = [reader.layer(i) for i in range(spec.num_layers)]
    vocab = None if whole else shard.vocab_rows

    def vocab_rows(name: str):
        if quantized is not None:  # a packed LM head (or GGUF's packed token embedding) where the file has one
            return quantized.projection([name.removesuffix(".weight")], [vocab],
                                        pad_rows=None if whole else shard.vocab_shard)
        x = ckpt.read(name, vocab)
        return put(x if whole else _pad_rows(x, shard.vocab_shard))

    embed = vocab_rows("embed_tokens.weight")
    stored_head = any(f"lm_head.{t}" in ckpt for t in ("weight", "qweight", "weight_packed"))
    lm_head = vocab_rows("lm_head.weight") if stored_head and not spec.tie_word_embeddings else embed
    weights = {"embed": embed, "layers": layers, "norm": put(ckpt.read("norm.weight")), "lm_head": lm_head}
    model = DecoderModel(spec, weights, device, dtype, attention_backend, group, shard, max_model_len)
    model.checkpoint_kv_scales = read_kv_scales(ckpt, spec.num_layers)
    return model


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
               group: RankGroup | None = None, max_model_len: int | None = None, quantization: str | None = None,
               gguf: Path | None = None):
    """The model (this rank's shard of it when `group` is given), its Hugging Face config, and the path
    that runs it ("pagedserve" or "transformers"), logged. `gguf`: a GGUF file whose weights are read as
    they are (`model_dir` then holds its config and tokenizer); `quantization`: what --quantization asked
    for (a checkpoint of another kind is refused)."""
    model_dir = Path(model_dir)
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    # Refuses, by method and field, what it does not serve. A GGUF file's config was extracted without its
    # quantization_config: its tensors carry their types.
    scheme = None if gguf is not None else parse_quantization(hf_cfg)
    check_requested(scheme, quantization, gguf is not None)
    choice = choose_model(hf_cfg)
    if choice.path == MODULE_PATH:
        model = load_decoder(choice, model_dir, dtype, device, attention_backend, group, max_model_len, scheme,
                             gguf)
    else:
        if scheme is not None or gguf is not None:
            raise UnsupportedModelError(
                f"{choice.architecture} runs on the transformers path, which reads unquantized weights only: "
                f"a {'GGUF file read as it is' if gguf is not None else scheme.method + ' checkpoint'} is served "
                "for the family modules' architectures")
        from services.engine.models.transformers_backend import load_transformers_model

        model = load_transformers_model(choice, model_dir, dtype, device, attention_backend, group, max_model_len)
    log.info("%s runs on the %s path%s", choice.architecture, choice.path,
             "" if choice.path == MODULE_PATH else " (transformers' own model class, pagedserve's paged attention)")
    if choice.path == MODULE_PATH:
        for rope in model.ropes:
            note = rope_note(rope.spec, model.max_model_len)
            if note:
                log.info("%s", note)
    return model, hf_cfg, choice.path


RANDOM_DRAW_DTYPE = "_random_draw_dtype"


def random_model(hf_cfg: dict, dtype: torch.dtype, device: torch.device, attention_backend: str = "auto",
                 seed: int = 0, group: RankGroup | None = None, max_model_len: int | None = None) -> DecoderModel:
    """A model of `hf_cfg`'s shapes with random weights drawn on the device (no download, no disk); with
    `group`, this rank's shard's shapes."""
    c = model_spec(hf_cfg)
    if c.moe is not None or c.mla is not None:
        raise UnsupportedModelError(f"{c.architecture}: random weights are drawn for dense models only; save a random "
                                    "checkpoint with transformers' own classes and pass its directory")
    shard = plan_shard(c, group)
    gen = torch.Generator(device=device).manual_seed(seed + (0 if shard is None else shard.rank))
    # RANDOM_DRAW_DTYPE in the config: draw the values in that dtype, then hold them in `dtype`. A float32
    # model drawn in bfloat16 holds exactly a bfloat16 model's weights (the GPU check's float32 reference).
    draw_name = hf_cfg.get(RANDOM_DRAW_DTYPE)
    draw = getattr(torch, draw_name) if draw_name else dtype

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=draw, device=device).mul_(std).to(dtype)

    def norm(n: int) -> torch.Tensor:  # a unit multiplier in either norm convention
        return (torch.zeros if c.norm_offset_one else torch.ones)(n, dtype=dtype, device=device)

    heads, kv_heads = (c.num_heads, c.num_kv_heads) if shard is None else (shard.num_heads, shard.num_kv_heads)
    inter = c.intermediate_size if shard is None else shard.intermediate
    vocab = c.vocab_size if shard is None else shard.vocab_shard
    qkv_rows = (heads + 2 * kv_heads) * c.head_dim
    first = shard is None or shard.rank == 0
    layers = []
    for _ in range(c.num_layers):
        layer = {role: norm(c.hidden_size) for role, _ in c.layout.norms}
        layer.update(qkv=rand(qkv_rows, c.hidden_size), o=rand(c.hidden_size, heads * c.head_dim),
                     gate_up=rand(2 * inter, c.hidden_size), down=rand(c.hidden_size, inter))
        if c.qk_norm:
            layer.update(q_norm=norm(c.head_dim), k_norm=norm(c.head_dim))
        if c.qkv_bias:
            layer["qkv_bias"] = rand(qkv_rows)
        if c.mlp_bias:
            layer["gate_up_bias"] = rand(2 * inter)
        if c.o_bias and first:
            layer["o_bias"] = rand(c.hidden_size)
        if c.mlp_bias and first:
            layer["down_bias"] = rand(c.hidden_size)
        layers.append(layer)
    embed = rand(vocab, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else rand(vocab, c.hidden_size)
    weights = {"embed": embed, "layers": layers, "norm": norm(c.hidden_size), "lm_head": lm_head}
    return DecoderModel(c, weights, device, dtype, attention_backend, group, shard, max_model_len)
