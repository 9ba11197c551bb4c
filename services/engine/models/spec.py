"""What the shared decoder (models/decoder.py) needs to know about one checkpoint: `DecoderSpec`.

A family module (models/llama.py, qwen3.py, gemma.py, phi3.py, mixtral.py, qwen3_moe.py,
deepseek_v3.py, gpt_oss.py) reads a Hugging Face
`config.json` into a DecoderSpec, refusing by name any field whose value changes the math in a way
the decoder does not implement; the decoder and the loader read nothing else. The field names the
LoRA slots and the tensor-parallel plan read (num_layers, num_heads, num_kv_heads, head_dim,
hidden_size, intermediate_size, vocab_size) are the same as they were on the Llama-only config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.layers.mla import MlaSpec
from services.engine.layers.moe import MoeSpec
from services.engine.layers.rotary import RopeSpec


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something pagedserve does not serve exactly: the message names the
    architecture or config field (and its value)."""


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: its window (None: every earlier position) and its rotary embedding."""

    window: int | None
    rope: RopeSpec


@dataclass(frozen=True)
class CheckpointLayout:
    """How a family's layer tensors are named on disk (after the "model." prefix)."""

    fused_qkv: bool = False  # one self_attn.qkv_proj instead of q_proj / k_proj / v_proj (Phi-3)
    fused_gate_up: bool = False  # one mlp.gate_up_proj instead of gate_proj / up_proj (Phi-3)
    # The decoder's norm roles -> checkpoint names under "layers.{i}.".
    norms: tuple[tuple[str, str], ...] = (("input_norm", "input_layernorm"),
                                          ("mlp_norm", "post_attention_layernorm"))


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's MoE block is named on disk, under "layers.{i}."."""

    block: str = "mlp"  # the MoE block ("block_sparse_moe" for Mixtral)
    router: str = "gate"  # its router linear ("router" for gpt-oss)
    # Per-expert tensors "experts.{e}.<name>.weight" as (gate, up, down); None: fused 3-D tensors
    # "experts.gate_up_proj" [E, hidden, 2I] (gate and up columns interleaved) and "experts.down_proj"
    # [E, I, hidden], as gpt-oss stores them.
    expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    shared: str | None = None  # DeepSeek's "shared_experts" (a plain gate/up/down MLP)


LLAMA_NORMS = (("input_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
# Gemma's "post_attention_layernorm" normalises the attention output; the MLP has its own pair.
GEMMA_NORMS = (("input_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
               ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm"))


@dataclass
class ModelShape:
    """The sizes every model path reports (the runner, the KV cache, the TP plan and LoRA read these)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


@dataclass
class DecoderSpec(ModelShape):
    rms_norm_eps: float
    tie_word_embeddings: bool
    layers: tuple[LayerAttention, ...]
    hidden_act: str = "silu"
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2 always, others with attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(score / cap) before the softmax
    final_logit_softcap: float | None = None  # Gemma 2: the same on the LM head's logits
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    norm_offset_one: bool = False  # Gemma: norms multiply by 1 + w, in float32
    norm_float_product: bool = False  # gpt-oss: norms multiply by w in float32, then cast
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to the model dtype
    layout: CheckpointLayout = field(default_factory=CheckpointLayout)
    # Mixture of experts: the expert layer's spec, the layers that have one (the rest are dense MLPs of
    # `intermediate_size`), and the checkpoint's names for it.
    moe: MoeSpec | None = None
    moe_layers: frozenset[int] = frozenset()
    expert_layout: ExpertLayout | None = None
    # Multi-head latent attention (DeepSeek): num_kv_heads is 1 and head_dim the cached latent's width.
    mla: MlaSpec | None = None
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in the softmax denominator

    def __post_init__(self):
        assert len(self.layers) == self.num_layers, (len(self.layers), self.num_layers)
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert (self.moe is None) == (self.expert_layout is None) and (self.moe is not None or not self.moe_layers)
        if self.mla is not None:
            assert self.num_kv_heads == 1 and self.head_dim == self.mla.cache_dim, (self.num_kv_heads, self.head_dim)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def sandwich_norms(self) -> bool:
        return any(role == "attn_out_norm" for role, _ in self.layout.norms)

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.layers]
