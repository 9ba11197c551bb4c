"""`pagedserve bench serve --lora-adapters 0,1,4`: the online cost of LoRA adapters through HTTP, as a ratio
to the base model in the same run.

One `pagedserve serve` starts with as many seeded random rank-8 adapters (every projection, PEFT format)
as the largest count, `--max-loras` of them resident. At each rate, each count runs the same workload
with its requests' `model` cycling over that many adapters (0: the base model), counts in order and then
in reverse (a drift in the machine's load lands on every count alike; each figure is the mean of the
two). Every run's prompts are the rate's prompts under a fresh seeded permutation of the vocabulary:
the same lengths and the same sharing between requests, but nothing another run left in the prefix
cache can hit.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from services.bench.offline.lora_mix import RANK, model_config, write_random_adapter
from services.bench.serve.workloads import ServeRequest


def remap(requests: list[ServeRequest], vocab_size: int, seed: int) -> list[ServeRequest]:
    """The requests with every prompt token sent through one seeded permutation of the vocabulary."""
    perm = list(range(vocab_size))
    random.Random(seed).shuffle(perm)
    return [replace(r, prompt=[perm[t] for t in r.prompt] if r.prompt is not None else None) for r in requests]


def start_server(args, port: int, log_dir: Path, adapters: int, adapter_dir: Path):
    from services.bench.serve.servers import pagedserve_server
    from services.model_files.model_source import resolve_model

    config = model_config(resolve_model(args.model))
    modules = [f"lora{i}={write_random_adapter(adapter_dir / f'lora{i}', config, seed=args.seed + i)}"
               for i in range(adapters)]
    extra = ["--max-loras", str(max(1, adapters)), "--max-lora-rank", str(RANK)]
    if modules:
        extra += ["--lora-modules", *modules]
    return pagedserve_server("serve", args, port, log_dir, extra)


def run(args, counts: list[int], rates: list[float], workloads: list[list[ServeRequest]], vocab: int,
        slo, log_dir: Path) -> dict:
    from services.bench.serve.load import run_load
    from services.bench.serve.metrics import summarize
    from services.bench.serve.workloads import Lengths, WorkloadSpec, make_serve_workload
    from services.commands.ports import free_port

    if any(r.prompt is None for w in workloads for r in w):
        raise ValueError("--lora-adapters needs a workload of token prompts: random, chat or shared-prefix")
    report: dict = {"rank": RANK, "counts": counts, "rates": rates, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, free_port(), log_dir, max(counts), Path(tmp))
        try:
            base = server.wait_ready()
            names = {k: [base] if k == 0 else [f"lora{i}" for i in range(k)] for k in counts}
            warm = make_serve_workload(WorkloadSpec("random", max(args.warmup, max(counts) + 1), Lengths(16, 64),
                                                    Lengths(8, 8), seed=args.seed + 99), vocab)
            asyncio.run(run_load(server.url, [base] + names[max(counts)], warm, math.inf, "poisson", 1.0, None, 0,
                                 True, progress=False))
            order = [*counts, *reversed(counts)]
            for i, (rate, requests) in enumerate(zip(rates, workloads, strict=True)):
                for j, k in enumerate(order):
                    run_requests = remap(requests, vocab, args.seed + 7919 * (i * len(order) + j + 1))
                    results, duration = asyncio.run(run_load(
                        server.url, names[k], run_requests, rate, args.arrival, args.burstiness, args.concurrency,
                        args.seed, not args.no_ignore_eos))
                    s = summarize(results, duration, slo)
                    report["runs"].append({"adapters": k, "rate": rate, "pass": 1 if j < len(counts) else 2,
                                           **{key: s[key] for key in ("completed", "failed", "output_throughput",
                                                                      "ttft_s", "tpot_s")}})
                    print(f"  rate {rate:g}, {k} adapter(s), pass {report['runs'][-1]['pass']}: "
                          f"{s['output_throughput']:.1f} out tok/s, TTFT p50 {_ms(s['ttft_s'])}, "
                          f"TPOT p50 {_ms(s['tpot_s'])}, {s['failed']} failed", flush=True)
        finally:
            server.stop()
    report["summary"] = _summary(report["runs"], counts, rates)
    _print(report, args)
    return report


def _ms(dist: dict) -> str:
    p50 = (dist or {}).get("p50")
    return "-" if p50 is None else f"{p50 * 1000:.0f} ms"


def _summary(runs: list[dict], counts: list[int], rates: list[float]) -> list[dict]:
    out = []
    for rate in rates:
        base = None
        for k in counts:
            mine = [r for r in runs if r["rate"] == rate and r["adapters"] == k]
            row = {"rate": rate, "adapters": k,
                   "output_throughput": statistics.fmean(r["output_throughput"] for r in mine),
                   "failed": sum(r["failed"] for r in mine),
                   "ttft_p50_s": statistics.fmean(r["ttft_s"]["p50"] or 0 for r in mine),
                   "tpot_p50_s": statistics.fmean(r["tpot_s"]["p50"] or 0 for r in mine)}
            if k == 0:
                base = row["output_throughput"]
            row["ratio_to_base"] = row["output_throughput"] / base if base else None
            out.append(row)
    return out


def _print(report: dict, args) -> None:
    print(f"\nLoRA cost online (pagedserve serve, rank {RANK} on every projection, workload {args.workload}, "
          f"{args.dtype}; mean of the in-order and reversed passes):")
    print(f"{'rate':>6} {'adapters':>9} {'out tok/s':>10} {'ratio to base':>14} {'TTFT p50':>9} {'TPOT p50':>9} "
          f"{'failed':>7}")
    for r in report["summary"]:
        ratio = f"{r['ratio_to_base']:.3f}" if r["ratio_to_base"] else "-"
        print(f"{r['rate']:>6g} {r['adapters']:>9} {r['output_throughput']:>10.1f} {ratio:>14} "
              f"{r['ttft_p50_s'] * 1000:>7.0f}ms {r['tpot_p50_s'] * 1000:>7.0f}ms {r['failed']:>7}")
