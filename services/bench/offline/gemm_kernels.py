"""`pagedserve bench gemm`: the CPU linears' kernels alone at a model's shapes, and the memory's copy rate.

For each linear of the model (its out x in features, the Llama shapes read from its config) and each
row count m, the wall time of pagedserve's AVX512-BF16 `bf16_gemm` on its packed panels and of PyTorch's
`F.linear` (oneDNN: on AMX tiles where the CPU has them and `ONEDNN_MAX_CPU_ISA` allows), as GFLOP/s,
medians of timed batches, and `bf16_gemm`'s share of the chip's bfloat16 dot-product peak (vdpbf16ps on
every thread, measured in the same run: the ceiling of any exact bf16 GEMM on a CPU without AMX); then the
rates of a plain 1 GiB bfloat16 copy and of a 1 GiB read, the bounds of every step that reads the weights
or the KV cache once. The engine's choice between the two GEMMs is printed beside
(services/engine/linear.py). The kernels run on what they just read, so small shapes time cache-resident
weights: the figures are the kernels' rates, not a decode step's.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path


def _rate(fn, flops: float, seconds: float = 0.2) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            fn()
            n += 1
        samples.append((time.perf_counter() - start) / n)
    return flops / statistics.median(samples) / 1e9


def model_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(out, in) features of the four linears of a Llama-shaped layer, from the model's config.json."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def _median_seconds(fn, runs: int = 5) -> float:
    fn()  # first touch: pages faulted in, not timed
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_rate_gb_s(gib: float = 1.0) -> float:
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / _median_seconds(lambda: y.copy_(x)) / 1e9  # read + write


def read_rate_gb_s(gib: float = 1.0) -> float:
    """A float32 sum over `gib` GiB on every thread: reads only (a decode step's KV and weights are reads)."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    return x.numel() * 4 / _median_seconds(x.sum) / 1e9


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    import kernels.cpu as kc
    from services.bench.host_cpu import describe_cpu
    from services.engine.linear import cpu_gemm_choice
    from services.model_files.model_source import resolve_model

    mod = kc.load()
    ours = mod is not None and mod.bf16_gemm_supported()
    shapes = model_shapes(resolve_model(args.model))
    report = {"cpu": describe_cpu(), "engine_linears": cpu_gemm_choice(), "amx_in_use": kc.amx_in_use(),
              "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "(unset)"), "rows": []}
    print(f"{report['cpu']}; the engine's linears here: {report['engine_linears']} (AMX in use: "
          f"{report['amx_in_use']}); ONEDNN_MAX_CPU_ISA={report['ONEDNN_MAX_CPU_ISA']}", flush=True)
    if not ours:
        print("pagedserve's bf16_gemm is not built for this CPU (no AVX512-BF16): oneDNN only", flush=True)
    peak = mod.bf16_dot_peak_gflops(0.5) if ours else None
    report["bf16_dot_peak_gflops"] = peak
    if peak:
        print(f"bfloat16 dot-product peak (vdpbf16ps, {torch.get_num_threads()} threads): {peak:.0f} GFLOP/s",
              flush=True)
    torch.manual_seed(args.seed)
    print(f"{'linear':<8}{'out x in':>12}{'m':>6}{'bf16_gemm GFLOP/s':>20}{'of peak':>9}{'F.linear GFLOP/s':>19}",
          flush=True)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k).bfloat16()
        packed = mod.bf16_gemm_pack(w.contiguous()) if ours else None
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            flops = 2.0 * m * n * k
            mine = _rate(lambda: mod.bf16_gemm(x, packed, n, None), flops) if ours else None  # noqa: B023
            theirs = _rate(lambda: F.linear(x, w), flops)  # noqa: B023
            share = mine / peak if mine is not None and peak else None
            report["rows"].append({"linear": name, "out": n, "in": k, "m": m, "bf16_gemm_gflops": mine,
                                   "bf16_gemm_share_of_peak": share, "torch_linear_gflops": theirs})
            mine_s = f"{mine:.0f}" if mine is not None else "-"
            share_s = f"{share:.0%}" if share is not None else "-"
            print(f"{name:<8}{f'{n}x{k}':>12}{m:>6}{mine_s:>20}{share_s:>9}{theirs:>19.0f}", flush=True)
    report["copy_gb_s"] = copy_rate_gb_s()
    report["read_gb_s"] = read_rate_gb_s()
    print(f"memory: a 1 GiB bfloat16 copy moves {report['copy_gb_s']:.1f} GB/s (read + write); a 1 GiB read "
          f"{report['read_gb_s']:.1f} GB/s", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0
