"""The model `bench paper` runs when no `--model` is given: a 2-layer random Llama (hidden 64) with the
bundled SmolLM2's tokenizer, written once into pagedserve's cache.

Why a toy by default: the benchmark compares how serving systems schedule and place KV blocks, on one
engine. Its traces run random token ids with EOS ignored, so what the weights compute never matters,
only what a step costs. SmolLM2's steps cost 50-150 ms on a 2-core CPU, and a bisection over five
systems and two workloads needs some sixty runs of a few hundred requests each: hours. With this model
the default run fits in 15 minutes; `--model` runs the same search on real weights.
"""

from __future__ import annotations

from pathlib import Path

from services.model_files.model_source import cache_root
from services.model_files.random_checkpoint import write_random_checkpoint

NAME = "bench-paper-tiny-llama-v1"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)


def tiny_model_dir() -> Path:
    """The directory of the default model, built on first use (seeded: the same weights everywhere)."""
    return write_random_checkpoint(cache_root() / "models" / NAME, "LlamaConfig", "LlamaForCausalLM", SHAPE,
                                   "float32")
