"""Baseline: Hugging Face transformers with request-level static batching.

Requests are cut into batches of 32 in arrival order, left-padded, and each batch runs until its
longest request is done (the behaviour continuous batching removes). Only the tokens each request
asked for count as output.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from services.bench.offline.workloads import BenchRequest


def run_transformers(model_dir, requests: list[BenchRequest], dtype: str = "bfloat16", batch_size: int = 32) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
    pad = 0
    useful = 0
    start = time.perf_counter()
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc="transformers", unit="batch"):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n:] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=pad)
        useful += sum(r.output_len for r in batch)
    elapsed = time.perf_counter() - start
    return {"system": f"transformers (static batches of {batch_size})", "output_tokens": useful,
            "seconds": elapsed, "tokens_per_s": useful / elapsed}
