"""`pagedserve bench prefill-attention`: a fresh prompt's causal attention, kernel by kernel, at a model's
head shape and each prompt length.

PyTorch's CPU flash attention (`F.scaled_dot_product_attention`, causal, `enable_gqa`, called the way
services/engine/cpu_prefill.py calls it) against pagedserve's C++ kernels that this CPU can run: the AMX
one (`amx_prefill`, where the tiles are usable) and the AVX512-BF16 one (`prefill_bf16`), bfloat16, all
threads; medians of timed batches, the systems alternating batch by batch, as GFLOP/s (4 x L^2/2 x
head_dim x query heads per call) and as each kernel's speed over SDPA's. The engine's choice for each
length is printed beside (`_fresh_kernel`: the AMX kernel up to AMX_PREFILL_MAX_TOKENS, SDPA above).
Every kernel's output is checked against SDPA's before it is timed.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def _timed(fns: dict, seconds: float) -> dict[str, float]:
    """Median seconds per call of each fn, batches of each alternating."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(5):
        for name, fn in fns.items():
            n, start = 0, time.perf_counter()
            while n < 2 or time.perf_counter() - start < seconds / 5 / len(fns):
                fn()
                n += 1
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(lengths: list[int], heads: int, kv_heads: int, head_dim: int, seconds: float = 0.4,
            seed: int = 0) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels.cpu import amx_in_use, load
    from services.engine.cpu_prefill import _fresh_kernel

    mod = load()
    kernels = {}
    if mod is not None and amx_in_use() and mod.amx_prefill_supported(head_dim):
        kernels["amx_prefill"] = mod.amx_prefill
    if mod is not None and mod.prefill_bf16_supported(head_dim):
        kernels["prefill_bf16"] = mod.prefill_bf16
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        q = torch.randn(n, heads, head_dim, generator=g).bfloat16()
        k, v = (torch.randn(n, kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
        scale = head_dim ** -0.5

        def sdpa(q=q, k=k, v=v, scale=scale):
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                                  enable_gqa=kv_heads != heads)[0].transpose(0, 1)

        want = sdpa().float()
        fns = {"sdpa": sdpa}
        for name, kernel in kernels.items():
            err = (kernel(q, k, v, scale).float() - want).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.abs().max().item()), f"{name} at {n} tokens differs by {err}"
            fns[name] = lambda kernel=kernel, q=q, k=k, v=v, scale=scale: kernel(q, k, v, scale)
        times = _timed(fns, seconds)
        flops = 4 * n * n / 2 * head_dim * heads
        chosen = _fresh_kernel(q, n)
        row = {"tokens": n, "engine_takes": "sdpa" if chosen is None else chosen.__name__,
               "gflop_s": {name: round(flops / t / 1e9, 1) for name, t in times.items()},
               "ms": {name: round(t * 1e3, 3) for name, t in times.items()}}
        row["speed_over_sdpa"] = {name: round(times["sdpa"] / times[name], 2) for name in kernels}
        rows.append(row)
    return rows


def run(args) -> int:
    import torch

    from services.bench.offline.throughput import machine as machine_of
    from services.model_files.model_source import resolve_tokenizer

    config = json.loads((resolve_tokenizer(args.model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    machine = machine_of()
    print(f"{machine['cpu']}, {torch.get_num_threads()} threads, ISA {' '.join(machine['isa'])}; "
          f"{heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, bfloat16", flush=True)
    rows = measure(args.lengths, heads, kv_heads, head_dim, seed=args.seed)
    names = [n for n in rows[0]["ms"] if n != "sdpa"] if rows else []
    print(f"{'tokens':>7} {'sdpa ms':>9} {'GFLOP/s':>8} " + " ".join(f"{n + ' ms':>16} {'x sdpa':>7}" for n in names)
          + "  engine takes")
    for r in rows:
        print(f"{r['tokens']:>7} {r['ms']['sdpa']:>9.3f} {r['gflop_s']['sdpa']:>8.1f} "
              + " ".join(f"{r['ms'][n]:>16.3f} {r['speed_over_sdpa'][n]:>7.2f}" for n in names)
              + f"  {r['engine_takes']}")
    if args.json_path:
        out = {"command": "pagedserve bench prefill-attention", "machine": machine, "threads": torch.get_num_threads(),
               "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": rows}
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")
    return 0
