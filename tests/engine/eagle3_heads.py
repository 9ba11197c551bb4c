"""Random-weight EAGLE-3 heads in the published checkpoints' layout, for tests: they propose nonsense,
and the output must not change."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def random_eagle3_head(target_dir: Path, out: Path, seed: int = 0, draft_vocab: int | None = None,
                       layer_prefix: str = "midlayer.", aux_layers: list[int] | None = None) -> Path:
    """A head for the model in `target_dir`: `midlayer.*` (or `layers.0.*`), fc, norm, lm_head over a draft
    vocabulary and, when that is smaller than the target's, d2t/t2d as the published heads carry them."""
    from safetensors.torch import save_file

    t = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab, inter = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    heads = t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    hd = t.get("head_dim") or hidden // heads
    draft_vocab = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def rnd(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    shapes = {"self_attn.q_proj": (heads * hd, 2 * hidden), "self_attn.k_proj": (kv * hd, 2 * hidden),
              "self_attn.v_proj": (kv * hd, 2 * hidden), "self_attn.o_proj": (hidden, heads * hd),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    tensors = {f"{layer_prefix}{name}.weight": rnd(*shape) for name, shape in shapes.items()}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{layer_prefix}{norm}.weight"] = torch.ones(hidden)
    tensors.update({"norm.weight": torch.ones(hidden), "fc.weight": rnd(hidden, 3 * hidden),
                    "lm_head.weight": rnd(draft_vocab, hidden)})
    if draft_vocab != vocab:
        ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
           "num_hidden_layers": 1, "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "rope_theta": t.get("rope_theta", 1e4),
           "max_position_embeddings": t.get("max_position_embeddings", 4096), "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "target_hidden_size": hidden}
    if aux_layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
