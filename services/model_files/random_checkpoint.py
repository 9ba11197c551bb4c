"""A random-weight checkpoint in a given shape, written once by transformers' own classes (the Hub's
tensor layout) with the bundled SmolLM2's tokenizer: what the benchmarks run when the comparison is of
serving, not of weights (`bench paper`'s default model, `bench moe-checkpoints`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from services.model_files.model_source import TOKENIZER_FILES, resolve_model


def write_random_checkpoint(out: Path, config_class: str, model_class: str, shape: dict, dtype: str,
                            seed: int = 0) -> Path:
    """`out`, holding transformers' `model_class` of `config_class(**shape)` with seeded random weights in
    `dtype`, the tokenizer's vocabulary and special tokens; written to a temporary directory and renamed,
    so a directory marked complete is whole. Written once: an existing complete one is returned as is."""
    if (out / "complete.txt").exists():
        return out
    import torch
    import transformers

    src = resolve_model(None)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if name != "config.json" and (src / name).exists():
            shutil.copy(src / name, tmp / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    config = getattr(transformers, config_class)(**shape, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                                 eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    getattr(transformers, model_class)(config).to(getattr(torch, dtype)).save_pretrained(str(tmp),
                                                                                          safe_serialization=True)
    (tmp / "complete.txt").write_text("written whole\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
