"""`pagedserve bench throughput --lora-adapters 0,1,4`: the cost of LoRA adapters, as a ratio to the base
model in the same run.

One engine with as many slots as the largest count; seeded random rank-8 adapters on every projection,
written in PEFT's format (adapter_config.json + safetensors) and loaded as any adapter is. For each
count the same workload runs with its requests spread round-robin over that many adapters (0: the base
model alone), and the table gives output tokens/s and the ratio to the base run."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from services.bench.workloads import offline_workload
from services.lora_files import TARGET_MODULES, tensor_key

RANK = 8


def write_random_adapter(out: Path, llm, seed: int, rank: int = RANK) -> Path:
    """A PEFT-format adapter of `rank` on every projection of `llm`'s model, seeded."""
    import torch
    from safetensors.torch import save_file

    from services.engine.lora.weights import module_dims

    m = llm.runner.model
    dims = module_dims(m.config, m.num_heads, m.num_kv_heads)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(m.config.num_layers):
        for module in TARGET_MODULES:
            fan_in, fan_out = dims[module]
            tensors[tensor_key(layer, module, "A")] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[tensor_key(layer, module, "B")] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
        "bias": "none"}))
    return out


def _timed(llm, requests, names) -> dict:
    from services import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False, lora_request=names)
    elapsed = time.perf_counter() - start
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": n, "seconds": elapsed, "tokens_per_s": n / elapsed}


def run(args, counts: list[int]) -> dict:
    from services import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_loras=max(1, *counts), max_lora_rank=RANK)
    requests = offline_workload(args.workload, llm.core.info.vocab_size, seed=args.seed, scale=args.scale)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(max(counts)):
            llm.load_lora(f"lora{i}", str(write_random_adapter(Path(tmp) / f"lora{i}", llm, seed=args.seed + i)))
        # Warm-up outside the clock (kernels, allocator), with every adapter once.
        warm = [(7919 * i) % 4000 + 100 for i in range(32)]
        llm.generate([warm] * (max(counts) + 1), SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                     lora_request=[None] + [f"lora{i}" for i in range(max(counts))])
        results = []
        for k in counts:
            llm.core.pool.reset_cache()  # no run reuses another's prefixes
            names = [None if k == 0 else f"lora{i % k}" for i in range(len(requests))]
            results.append({"adapters": k, **_timed(llm, requests, names)})
    base = next((r for r in results if r["adapters"] == 0), None)
    for r in results:
        if base is not None:
            r["ratio_to_base"] = r["tokens_per_s"] / base["tokens_per_s"]
    print(f"\nLoRA cost, rank {RANK} on every projection, workload {args.workload} ({len(requests)} requests, "
          f"{args.dtype}, {llm.runner.device}):")
    print(f"{'adapters in the mix':<22} {'tok/s':>9} {'ratio to base':>14}")
    for r in results:
        ratio = r.get("ratio_to_base")
        print(f"{r['adapters']:<22} {r['tokens_per_s']:>9.1f} {(f'{ratio:.3f}' if ratio else '-'):>14}")
    llm.close()
    return {"workload": args.workload, "dtype": args.dtype, "rank": RANK, "lora_results": results}
