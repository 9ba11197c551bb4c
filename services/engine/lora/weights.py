"""One adapter's matrices, read from checked PEFT files and laid out the way this rank's fused projections
use them: per layer, per fused projection (qkv, o, gate_up, down), the A matrices of its parts stacked
row-wise and the B matrices stacked the same way along the output.

Under tensor parallelism each rank keeps the slice matching its shard of the base weights (as vLLM's
LoRA layers do): a column-parallel projection (q, k, v, gate, up) keeps its whole A and the rows of B
for its output rows (q by its query heads, k and v by its KV heads, replicated where the base replicates
them, gate and up by its MLP rows); a row-parallel one (o, down) keeps the columns of A for its input
columns and its whole B. A rank's partial delta is then summed by the all-reduce the base output already
takes (services/engine/lora/batch.py says why that is exact).

The files were checked by services/model_files/lora_files.py (names, ranks, dtypes, no pickle); here the shapes are
checked against the whole model, whose dimensions only the engine knows. A shape that does not fit is an
AdapterError naming the tensor, before anything reaches a slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as load_safetensors

from services.model_files.lora_files import AdapterError, AdapterFiles, tensor_key

if TYPE_CHECKING:
    from services.engine.tp_shard import TensorParallelShard

# The model's fused projections and the PEFT modules each one is made of, in output order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
ROW_PARALLEL = ("o_proj", "down_proj")  # input split across ranks; every other module's output is


def module_dims(config, num_heads: int | None = None, num_kv_heads: int | None = None,
                intermediate: int | None = None) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every PEFT target module of one layer of `config`, with `num_heads`
    query heads, `num_kv_heads` KV heads and `intermediate` MLP rows (a rank's; default: the whole model's)."""
    hidden, hd = config.hidden_size, config.head_dim
    heads = config.num_heads if num_heads is None else num_heads
    kv_heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    inter = config.intermediate_size if intermediate is None else intermediate
    q, kv = heads * hd, kv_heads * hd
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def shard_range(module: str, shard: TensorParallelShard) -> tuple[int, int]:
    """The range of the module's split dimension this rank holds: B's rows of a column-parallel module,
    A's columns of a row-parallel one (the same ranges the base weight is cut by)."""
    if module in ("q_proj", "o_proj"):
        return shard.q_rows
    if module in ("k_proj", "v_proj"):
        return shard.kv_rows
    return shard.mlp_rows


@dataclass
class LoraWeights:
    """An adapter in host memory: `layers[i][module] = (A [r, in], B [out, r])` for the modules it adapts,
    this rank's slices of them."""

    digest: str
    rank: int
    scale: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    nbytes: int


def load_weights(files: AdapterFiles, config, dtype: torch.dtype,
                 shard: TensorParallelShard | None = None) -> LoraWeights:
    dims = module_dims(config)
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
        a = tensors[tensor_key(layer, module, "A")]
        b = tensors[tensor_key(layer, module, "B")]
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(tensor_key(layer, module, "A"), "holds NaN or infinite values")
        if shard is not None:
            lo, hi = shard_range(module, shard)
            a, b = (a[:, lo:hi], b) if module in ROW_PARALLEL else (a, b[lo:hi])
        a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        layers[layer][module] = (a, b)
        nbytes += (a.numel() + b.numel()) * a.element_size()
    return LoraWeights(files.digest, files.rank, files.scale, layers, nbytes)
