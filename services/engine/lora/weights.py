"""One LoRA adapter's matrices, read from checked PEFT files and laid out the way the model's fused
projections use them: per layer, per fused projection (qkv, o, gate_up, down), the A matrices of its
parts stacked row-wise and the B matrices stacked the same way along the output.

The files were checked by services/lora_files.py (names, ranks, dtypes, no pickle); here the shapes are
checked against the model, whose dimensions only the engine knows. A shape that does not fit is an
AdapterError naming the tensor, before anything reaches a slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from services.lora_files import AdapterError, AdapterFiles, tensor_key

# The model's fused projections and the PEFT modules each one is made of, in output order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def module_dims(config, num_heads: int, num_kv_heads: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every PEFT target module of one layer of `config`."""
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = num_heads * hd, num_kv_heads * hd
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass
class LoraWeights:
    """An adapter in host memory: `layers[i][module] = (A [r, in], B [out, r])` for the modules it adapts."""

    digest: str
    rank: int
    scale: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    nbytes: int


def load_weights(files: AdapterFiles, config, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> LoraWeights:
    dims = module_dims(config, num_heads, num_kv_heads)
    for key, info in files.tensors.items():
        if info.layer >= config.num_layers:
            raise AdapterError(key, f"layer {info.layer} does not exist (the model has {config.num_layers})")
        fan_in, fan_out = dims[info.module]
        want = (files.rank, fan_in) if info.kind == "A" else (fan_out, files.rank)
        if info.shape != want:
            raise AdapterError(key, f"shape {list(info.shape)} does not fit the model (expected {list(want)})")
    try:
        tensors = load_safetensors(files.weights)
    except Exception as e:  # a header that parsed but data offsets that lie
        raise AdapterError("adapter_model.safetensors", f"cannot be read ({e})") from None
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    nbytes = 0
    for (layer, module) in sorted({(t.layer, t.module) for t in files.tensors.values()}):
        a = tensors[tensor_key(layer, module, "A")].to(dtype).contiguous()
        b = tensors[tensor_key(layer, module, "B")].to(dtype).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(tensor_key(layer, module, "A"), "holds NaN or infinite values")
        layers[layer][module] = (a, b)
        nbytes += (a.numel() + b.numel()) * a.element_size()
    return LoraWeights(files.digest, files.rank, files.scale, layers, nbytes)
