"""The model `bench paper` runs when no `--model` is given: a 2-layer random Llama (hidden 64) with the
bundled SmolLM2's tokenizer, written once into pagedserve's cache.

Why a toy by default: the benchmark compares how serving systems schedule and place KV blocks, on one
engine. Its traces run random token ids with EOS ignored, so what the weights compute never matters,
only what a step costs. SmolLM2's steps cost 50-150 ms on a 2-core CPU, and a bisection over five
systems and two workloads needs some sixty runs of a few hundred requests each: hours. With this model
the default run fits in 15 minutes; `--model` runs the same search on real weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from services.model_files.model_source import TOKENIZER_FILES, cache_root, resolve_model

NAME = "bench-paper-tiny-llama-v1"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)


def tiny_model_dir() -> Path:
    """The directory of the default model, built on first use (seeded: the same weights everywhere)."""
    out = cache_root() / "models" / NAME
    marker = out / "complete.txt"
    if marker.exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = resolve_model(None)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if name != "config.json" and (src / name).exists():
            shutil.copy(src / name, tmp / name)
    tok = AutoTokenizer.from_pretrained(str(src))
    config = LlamaConfig(**SHAPE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "complete.txt").write_text("written whole\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
