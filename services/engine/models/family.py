"""What a model family module registers: per architecture name, the transformers config class its
config.json is read with, the audit of that class's fields, and the function that builds the
DecoderSpec. Plus the helpers every family shares (sizes, per-layer windows from `layer_types`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.engine.layers.activations import ACTIVATIONS
from services.engine.models.hf_config import FieldAudit
from services.engine.models.spec import DecoderSpec, UnsupportedModelError

# The fields every family reads the same way.
SIZES = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                   "rope_parameters"})


@dataclass(frozen=True)
class Family:
    architecture: str  # the `architectures` entry of config.json
    model_type: str  # transformers' model_type, whose config class reads config.json
    config_class: str  # that class's name in transformers (the audit test looks it up)
    audit: FieldAudit
    build: Callable[..., DecoderSpec]  # (transformers config, architecture) -> DecoderSpec


def sizes(cfg, head_dim: int | None = None) -> dict:
    """The DecoderSpec fields every family reads alike."""
    heads = cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=cfg.num_key_value_heads or heads,
        head_dim=head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=float(cfg.rms_norm_eps), max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(cfg.tie_word_embeddings))


def activation(cfg, field: str = "hidden_act") -> str:
    """The MLP activation's name, refused by name where layers/activations.py does not implement it."""
    name = getattr(cfg, field)
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"config field {field}={name!r} is not supported (supported: "
                                    f"{', '.join(ACTIVATIONS)})")
    return name


def layer_windows(cfg, architecture: str) -> list[int | None]:
    """Per layer: the sliding window of a `sliding_attention` layer, None for `full_attention`."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers:
        raise UnsupportedModelError(f"{architecture}: config field layer_types has {len(types)} entries for "
                                    f"{cfg.num_hidden_layers} layers")
    out = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            window = cfg.sliding_window
            if not isinstance(window, int) or window < 1:
                raise UnsupportedModelError(f"{architecture}: layer {i} is sliding_attention but config field "
                                            f"sliding_window={window!r}")
            out.append(window)
        else:
            raise UnsupportedModelError(f"{architecture}: config field layer_types[{i}]={kind!r} is not supported "
                                        "(full_attention and sliding_attention are)")
    return out


def uniform_window(cfg, architecture: str) -> int | None:
    """Mistral / Phi-3: one `sliding_window` for every layer (None: full attention)."""
    window = cfg.sliding_window
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedModelError(f"{architecture}: config field sliding_window={window!r} is not a window")
    return window
