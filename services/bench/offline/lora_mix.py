"""`pagedserve bench throughput --lora-adapters 0,1,4`: the cost of LoRA adapters, as a ratio to the base
model in the same run.

One engine with as many slots as the largest count; seeded random rank-8 adapters on every projection,
written in PEFT's format (adapter_config.json + safetensors) and loaded as any adapter is. For each
count the same workload runs with its requests spread round-robin over that many adapters (0: the base
model alone), and the table gives output tokens/s and the ratio to the base run. Passes over the counts
alternate in order and in reverse (--lora-passes), and each figure is the median of its runs.

Wall-clock throughput on a shared VM moves by more than the effect measured (a neighbour's load, CPU
steal), so each run also records the process's CPU seconds per output token (every engine and scheduler
thread of this in-process engine, time.process_time): time the host took away is not counted there, and
its ratio to the base model's is the second, steadier figure of cost."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from services.bench.offline.workloads import offline_workload
from services.model_files.lora_files import TARGET_MODULES, tensor_key

RANK = 8


def write_random_adapter(out: Path, config, seed: int, rank: int = RANK) -> Path:
    """A PEFT-format adapter of `rank` on every projection of a model `config` (a DecoderSpec), seeded."""
    import torch
    from safetensors.torch import save_file

    from services.engine.lora.weights import module_dims

    dims = module_dims(config, config.num_heads, config.num_kv_heads)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
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


def model_config(model_dir: Path):
    """The model spec of a model directory, as the engine reads it."""
    from services.engine.model_loader import model_spec

    return model_spec(json.loads((Path(model_dir) / "config.json").read_text()))


def _timed(llm, requests, names) -> dict:
    from services import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False, lora_request=names)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": n, "seconds": elapsed, "tokens_per_s": n / elapsed, "cpu_ms_per_token": cpu * 1e3 / n}


def run(args, counts: list[int]) -> dict:
    from services import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_loras=max(1, *counts), max_lora_rank=RANK)
    requests = offline_workload(args.workload, llm.core.info.vocab_size, seed=args.seed, scale=args.scale)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(max(counts)):
            path = write_random_adapter(Path(tmp) / f"lora{i}", model_config(llm.runner.model_dir), seed=args.seed + i)
            llm.load_lora(f"lora{i}", str(path))
        # Warm-up outside the clock (kernels, allocator), with every adapter once.
        warm = [(7919 * i) % 4000 + 100 for i in range(32)]
        llm.generate([warm] * (max(counts) + 1), SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                     lora_request=[None] + [f"lora{i}" for i in range(max(counts))])
        # Passes alternately in order and reversed: a drift in the machine's load lands on every count alike.
        runs: dict[int, list[dict]] = {k: [] for k in counts}
        for p in range(args.lora_passes):
            for k in (counts if p % 2 == 0 else counts[::-1]):
                llm.core.pool.reset_cache()  # no run reuses another's prefixes
                names = [None if k == 0 else f"lora{i % k}" for i in range(len(requests))]
                runs[k].append(_timed(llm, requests, names))
                print(f"  {k} adapter(s), pass {len(runs[k])}: {runs[k][-1]['tokens_per_s']:.1f} output tok/s, "
                      f"{runs[k][-1]['cpu_ms_per_token']:.2f} CPU ms per token", flush=True)
        results = [{"adapters": k, "output_tokens": rs[0]["output_tokens"],
                    "seconds": statistics.median(r["seconds"] for r in rs),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                    "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in rs),
                    "runs_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rs],
                    "runs_cpu_ms_per_token": [round(r["cpu_ms_per_token"], 3) for r in rs]} for k, rs in runs.items()]
    base = next((r for r in results if r["adapters"] == 0), None)
    for r in results:
        if base is not None:
            r["ratio_to_base"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["cpu_ratio_to_base"] = base["cpu_ms_per_token"] / r["cpu_ms_per_token"]  # as a throughput ratio
    print(f"\nLoRA cost, rank {RANK} on every projection, workload {args.workload} ({len(requests)} requests, "
          f"{args.dtype}, {llm.runner.device}; medians of {args.lora_passes} passes):")
    print(f"{'adapters in the mix':<20} {'tok/s':>7} {'ratio':>6} {'CPU ms/tok':>11} {'CPU ratio':>10}  runs (tok/s)")
    for r in results:
        ratio, cpu_ratio = r.get("ratio_to_base"), r.get("cpu_ratio_to_base")
        print(f"{r['adapters']:<20} {r['tokens_per_s']:>7.1f} {(f'{ratio:.3f}' if ratio else '-'):>6} "
              f"{r['cpu_ms_per_token']:>11.2f} {(f'{cpu_ratio:.3f}' if cpu_ratio else '-'):>10}  "
              f"{' / '.join(f'{x:.1f}' for x in r['runs_tokens_per_s'])}")
    llm.close()
    return {"workload": args.workload, "dtype": args.dtype, "rank": RANK, "lora_results": results}
