"""The transformers modeling backend: any dense decoder-only architecture with no family module runs
transformers' own model class, with pagedserve's paged attention plugged in through transformers'
attention-function registry (`AttentionInterface`), as vLLM's and SGLang's Transformers backends do.

The model is transformers' module tree, loaded by `from_pretrained` with `attn_implementation=
"pagedserve"`. A step runs it once over the flattened batch (`[1, num_tokens]`, each token with its own
position id); every attention layer calls `paged_attention` below with its rotated query, key and value
and its own options (`scaling`, `sliding_window`, `softcap`), and that writes the new keys and values
into the layer's KV group's paged blocks and attends through the engine's attention backend (C++ on the
CPU, Triton on CUDA, or the references) with the step's block tables and slot mapping. transformers
builds no mask for an implementation it does not know: causality and windows are the kernels'.

Which layers slide is read from the model itself: one probe forward at load records each layer's
sliding window, and the KV groups are planned from those (services/engine/kv_groups.py), exactly as for
a family module. Served exactly, more slowly than a family module (no fused projections or C++ elementwise
kernels), and refused where it could not be exact: architectures whose attention does not go through the
registry, mixtures of experts (issue 31), attention sinks, tensor parallelism, LoRA adapters.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.engine.attention import AttentionMetadata, PagedAttention
from services.engine.kv_groups import plan_kv_groups
from services.engine.models.hf_config import parse_config
from services.engine.models.spec import ModelShape, UnsupportedModelError

if TYPE_CHECKING:
    from services.engine.models.choice import ModelChoice

log = logging.getLogger(__name__)

IMPLEMENTATION = "pagedserve"
# Config fields that mean experts: served by a MoE layer of pagedserve's own (issue 31), never here.
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def transformers_choice(raw: dict, archs: list[str], supported: list[str]) -> ModelChoice:
    """The transformers path for the first architecture transformers has a dense causal-LM class for."""
    import transformers

    from services.engine.models.choice import TRANSFORMERS_PATH, ModelChoice

    why = []
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if cls is None or not arch.endswith("ForCausalLM"):
            why.append(f"{arch}: no decoder-only causal-LM class of that name in transformers "
                       f"{transformers.__version__}")
            continue
        if not getattr(cls, "_supports_attention_backend", False):
            why.append(f"{arch}: its attention does not go through transformers' attention registry, so pagedserve's "
                       "paged attention cannot be plugged in")
            continue
        model_type = raw.get("model_type")
        if not model_type:
            why.append(f"{arch}: config.json has no model_type")
            continue
        cfg = parse_config(raw, model_type)
        experts = [f for f in _EXPERT_FIELDS if (getattr(cfg, f, None) or 0) > 0]
        if experts or getattr(cfg, "is_encoder_decoder", False):
            why.append(f"{arch}: config field {experts[0]}={getattr(cfg, experts[0])} (mixture of experts)" if experts
                       else f"{arch}: an encoder-decoder model")
            continue
        return ModelChoice(arch, TRANSFORMERS_PATH, None, cfg)
    raise UnsupportedModelError(f"unsupported architecture {sorted(archs)}: {'; '.join(why)}. pagedserve's own "
                                f"modules: {', '.join(supported)}")


@dataclass
class _Step:
    """What the attention function needs during one forward (one step at a time per engine process)."""

    attn: PagedAttention
    metas: list[AttentionMetadata]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    layer_group: tuple[int, ...]
    windows: list[int | None]


class _Context(threading.local):
    step: _Step | None = None
    probe: dict | None = None  # layer -> (sliding_window, softcap) while probing at load


_CONTEXT = _Context()


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                    softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: q/k/v `[1, heads, tokens, head_dim]` (RoPE applied) ->
    (`[1, tokens, heads, head_dim]`, None)."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise UnsupportedModelError(f"{type(module).__name__}: attention sinks are not supported on the "
                                    "transformers path")
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    probe = _CONTEXT.probe
    if probe is not None:  # load-time probe: one token, no cache; record the layer's options
        probe[layer] = (sliding_window, softcap)
        rep = q.shape[1] // v.shape[1]
        return v.repeat_interleave(rep, dim=1)[None].to(query.dtype), None
    step = _CONTEXT.step
    k_cache, v_cache = step.kv_caches[layer]
    out = step.attn(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache,
                    step.metas[step.layer_group[layer]], scale, window=step.windows[layer], softcap=softcap)
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention)


class TransformersModel:
    """The engine's model interface over a transformers module tree (one process: no tensor parallelism)."""

    def __init__(self, choice: ModelChoice, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 attention_backend: str, max_model_len: int | None):
        from transformers import AutoModelForCausalLM

        _register()
        self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                       attn_implementation=IMPLEMENTATION).to(device).eval()
        text = self.hf.config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        max_pos = getattr(text, "max_position_embeddings", None) or 2048
        self.config = ModelShape(choice.architecture, text.vocab_size, text.hidden_size,
                                 getattr(text, "intermediate_size", 0), text.num_hidden_layers, heads,
                                 getattr(text, "num_key_value_heads", None) or heads, head_dim, max_pos)
        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads = heads, self.config.num_kv_heads
        self.group = self.shard = None
        self.head_weight = None  # no float32 rescoring of near-ties: the logits are transformers'
        self.max_model_len = min(max_model_len or max_pos, max_pos)
        self.attn = PagedAttention(attention_backend, device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.hf.parameters())
        windows = self._probe_windows()
        self.windows = [w if w is not None and w < self.max_model_len else None for w in windows]
        self.kv_plan = plan_kv_groups(self.windows)

    @torch.inference_mode()
    def _probe_windows(self) -> list[int | None]:
        """Each layer's sliding window, as its attention module passes it (one token through the model)."""
        _CONTEXT.probe = {}
        try:
            ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            self.hf(input_ids=ids, position_ids=ids, use_cache=False)
            seen = _CONTEXT.probe
        finally:
            _CONTEXT.probe = None
        layers = self.config.num_layers
        if sorted(seen) != list(range(layers)):
            raise UnsupportedModelError(f"{self.config.architecture}: its attention layers did not all call the "
                                        f"attention registry (saw layers {sorted(seen)} of {layers})")
        return [seen[i][0] for i in range(layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sample_idx: torch.Tensor, lora=None):
        """(logits of the rows in `sample_idx`, None): transformers' own head and logit processing."""
        assert lora is None, "the transformers path serves no LoRA adapters"
        _CONTEXT.step = _Step(self.attn, metas, kv_caches, self.kv_plan.layer_group, self.windows)
        try:
            out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=sample_idx)
        finally:
            _CONTEXT.step = None
        return out.logits[0], None


def load_transformers_model(choice: ModelChoice, model_dir: Path, dtype: torch.dtype, device: torch.device,
                            attention_backend: str, group, max_model_len: int | None) -> TransformersModel:
    if group is not None:
        raise UnsupportedModelError(f"{choice.architecture} runs on the transformers path, which has no tensor "
                                    "parallelism: serve it with --tensor-parallel-size 1")
    return TransformersModel(choice, Path(model_dir), dtype, device, attention_backend, max_model_len)
