"""`pagedserve bench moe-checkpoints`: the two random checkpoints the MoE throughput figures run, written
by transformers' own classes (the Hub's tensor layout) with the bundled SmolLM2 tokenizer.

- `qwen3-moe-64x8`: Qwen3-MoE, hidden 1024, 4 layers, 16 query heads / 4 KV heads of 64, 64 experts of
  intermediate 256, top 8 (Qwen3-30B-A3B's routing at a CPU's size);
- `qwen3-dense-active`: the same model with one dense MLP of intermediate 8 x 256 = 2,048 per layer: the
  MoE model's active parameters per token, so the pair shows what routing and scattered experts cost.

Each is then measured as any model is: `pagedserve bench throughput --model DIR --against vllm,transformers`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.model_files.model_source import cache_root
from services.model_files.random_checkpoint import write_random_checkpoint

ATTENTION = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 max_position_embeddings=4096, tie_word_embeddings=True)
SHAPES = {
    "qwen3-moe-64x8": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(ATTENTION, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                            intermediate_size=2048, norm_topk_prob=True)),
    "qwen3-dense-active": ("Qwen3Config", "Qwen3ForCausalLM", dict(ATTENTION, intermediate_size=8 * 256)),
}


def write_checkpoint(name: str, out: Path) -> Path:
    """The named shape's random bfloat16 checkpoint in `out` (seeded), written once."""
    config_class, model_class, shape = SHAPES[name]
    return write_random_checkpoint(out, config_class, model_class, shape, "bfloat16")


def run(args: argparse.Namespace) -> int:
    root = Path(args.out) if args.out else cache_root() / "models"
    for name in SHAPES:
        path = write_checkpoint(name, root / f"bench-{name}-v1")
        print(f"{name}: {path}\n  pagedserve bench throughput --model {path} --against vllm,transformers")
    return 0
