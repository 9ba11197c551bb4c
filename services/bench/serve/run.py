"""`pagedserve bench serve`: online serving through HTTP, like `vllm bench serve`, in one command.

Targets: `--endpoint URL` (any OpenAI-compatible server), or servers this command starts and stops
itself, one after the other on the same workload: `--systems serve,up` (pagedserve's two ways to run)
and `--against vllm` (vLLM's OpenAI server from `make vllm-env`). Started servers get the same model
files, dtype, KV cache memory, max model length and thread binding (every core), and the same warm-up.
Prints one table row per system and rate; `--json` keeps everything, `--plot` draws latency against
rate and TTFT/TPOT distributions. Timings are noisy here: compare systems within one run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from services.bench.serve.load import run_load
from services.bench.serve.metrics import SLO, summarize
from services.bench.serve.servers import pagedserve_server, vllm_server
from services.bench.serve.workloads import (
    Lengths,
    WorkloadSpec,
    make_serve_workload,
    mark_structured,
)
from services.commands.bench_flags import lora_counts, one_of, parsed
from services.commands.flag_values import FlagError
from services.contracts import metric_names as M

_GUIDED = (M.GUIDED_MASK_SECONDS, M.GUIDED_MASK_STEPS, M.GUIDED_CONSTRAINED_ROWS, M.SAMPLED_ROWS)


def _exported(url: str, names: tuple[str, ...]) -> dict[str, float] | None:
    """The values of counters `names` in a server's /metrics (a labelled series' first sample); None where the
    server has no metrics or lacks one of them."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for name in names:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        if m is None:
            return None
        found[name] = float(m.group(1))
    return found


def guided_counters(url: str) -> dict[str, float] | None:
    """The structured-output counters a pagedserve server exports (None: another server, or no metrics)."""
    return _exported(url, _GUIDED)


def mask_cost(before: dict | None, after: dict | None) -> dict | None:
    """Mask time per step and the constrained share of sampled rows over one rate's run."""
    if before is None or after is None or after[M.GUIDED_MASK_STEPS] == before[M.GUIDED_MASK_STEPS]:
        return None
    d = {k: after[k] - before[k] for k in _GUIDED}
    return {"mask_ms_per_step": round(1000 * d[M.GUIDED_MASK_SECONDS] / d[M.GUIDED_MASK_STEPS], 3),
            "steps_with_masks": int(d[M.GUIDED_MASK_STEPS]),
            "constrained_share_of_rows": round(d[M.GUIDED_CONSTRAINED_ROWS] / max(1.0, d[M.SAMPLED_ROWS]), 3)}


_SPEC = (M.SPEC_DECODE_NUM_DRAFTS, M.SPEC_DECODE_NUM_DRAFT_TOKENS, M.SPEC_DECODE_NUM_ACCEPTED_TOKENS)


def spec_counters(url: str) -> dict[str, float] | None:
    """The speculative-decoding counters a server exports under vLLM's names (None: it does not speculate)."""
    return _exported(url, _SPEC)


def spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts, vLLM's
    convention) over one rate's run."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in _SPEC}
    drafts, drafted = d[M.SPEC_DECODE_NUM_DRAFTS], d[M.SPEC_DECODE_NUM_DRAFT_TOKENS]
    accepted = d[M.SPEC_DECODE_NUM_ACCEPTED_TOKENS]
    return {"drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None}


def parse_rates(text: str) -> list[float]:
    """'1,2,4' (req/s) or 'inf' / 'max' (every request at once)."""
    rates = [math.inf if r.strip() in ("inf", "max") else float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("expected comma-separated rates > 0 (req/s), or inf")
    return rates


def check_flags(args) -> None:
    """What `bench serve` refuses while its command line is parsed (services.commands.flag_rules): the
    lengths, rates and SLO through the parsers the run uses, and the systems to measure."""
    for dest, parse in (("input_len", Lengths.parse), ("output_len", Lengths.parse), ("rates", parse_rates),
                        ("slo", SLO.parse)):
        parsed(args, dest, parse)
    if args.systems:
        one_of(args, "systems", ("serve", "up"))
    if args.lora_adapters:
        parsed(args, "lora_adapters", lora_counts)
        if args.endpoint or args.against or args.structured:
            raise FlagError("--lora-adapters starts its own `pagedserve serve`: no --endpoint, --against or "
                            "--structured with it")
    elif not (args.endpoint or args.systems or args.against):
        raise FlagError("nothing to benchmark: give --endpoint URL, --systems serve[,up] and/or --against vllm")


def _row(system: str, rate: float, s: dict) -> str:
    def ms(d: dict, key: str) -> str:
        return f"{d[key] * 1000:.0f}" if d[key] is not None else "-"

    return (f"| {system} | {rate:g} | {s['completed']}/{s['requests']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.1f} | {ms(s['ttft_s'], 'p50')} / {ms(s['ttft_s'], 'p99')} | "
            f"{ms(s['tpot_s'], 'p50')} / {ms(s['tpot_s'], 'p99')} | {ms(s['itl_s'], 'p50')} | "
            f"{ms(s['e2e_s'], 'p50')} | {s['goodput']:.2f} | {s['errors'] or '-'} |")


TABLE_HEAD = ("| system | rate (req/s) | completed | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
              "ITL p50 ms | E2E p50 ms | goodput req/s | errors |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _lora(args, rates, workloads, vocab: int, slo: SLO, log_dir: Path) -> int:
    from services.bench.serve import lora as serve_lora

    try:
        report = serve_lora.run(args, lora_counts(args.lora_adapters), rates, workloads, vocab, slo, log_dir)
    except ValueError as exc:
        print(f"--lora-adapters: {exc}", file=sys.stderr)
        return 2
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str))
    return 0


def run(args) -> int:
    from services.commands.ports import free_port
    from services.model_files.model_source import resolve_model, resolve_tokenizer
    from services.model_files.tokenizer import ModelTokenizer

    spec = WorkloadSpec(args.workload, args.num_requests, Lengths.parse(args.input_len),
                        Lengths.parse(args.output_len), args.prefix_len, args.groups, args.turns, args.seed)
    vocab = ModelTokenizer(resolve_tokenizer(args.model)).vocab_size
    rates = parse_rates(args.rates)
    # Each rate gets its own prompts (same for every system): with one set, every rate after the first
    # would hit the prefix cache the previous rate filled and report prefill-free TTFTs.
    workloads = [make_serve_workload(replace(spec, seed=spec.seed + 1000 * i), vocab) for i in range(len(rates))]
    for i, w in enumerate(workloads):
        mark_structured(w, args.structured, spec.seed + i)
    requests = workloads[0]
    slo = SLO.parse(args.slo)
    log_dir = Path(args.log_dir or ".bench/logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    if getattr(args, "lora_adapters", None):
        return _lora(args, rates, workloads, vocab, slo, log_dir)
    systems: list[tuple[str, object]] = []
    if args.endpoint:
        systems.append(("endpoint", args.endpoint.rstrip("/")))
    speculative = getattr(args, "speculative_config", None)
    for mode in [m.strip() for m in (args.systems or "").split(",") if m.strip()]:
        systems.append((f"pagedserve {mode}", lambda port, mode=mode: pagedserve_server(mode, args, port, log_dir)))
        if speculative:  # the same server with speculative decoding, right after it on the same workload
            systems.append((f"pagedserve {mode} +spec", lambda port, mode=mode: pagedserve_server(
                mode, args, port, log_dir, ["--speculative-config", speculative],
                log_name=f"pagedserve-{mode}-spec")))
    if args.against == "vllm":
        model_dir = resolve_model(args.model)
        served = args.served_model_name or "SmolLM2-135M-Instruct"
        systems.append(("vllm", lambda port: vllm_server(args, port, model_dir, served, log_dir)))
    print(f"workload {spec.name}: {len(requests)} {'sessions' if spec.name == 'multi-turn' else 'requests'}, "
          f"rates {args.rates}, arrival {args.arrival}, SLO {slo}; machine {os.cpu_count()} cores", flush=True)
    report = {"workload": asdict(spec), "rates": args.rates, "arrival": args.arrival, "slo": str(slo),
              "systems": {}}
    for name, target in systems:
        server = None
        try:
            try:
                if callable(target):
                    server = target(free_port())
                    url = server.url
                    model = server.wait_ready()
                else:
                    url, model = target, httpx.get(target + "/v1/models", timeout=30).json()["data"][0]["id"]
            except (RuntimeError, httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                # A server that did not start (its log named), or an endpoint that does not answer /v1/models.
                raise SystemExit(f"pagedserve bench serve: {name}: {type(exc).__name__}: {exc}") from None
            warm = make_serve_workload(WorkloadSpec("random", args.warmup, Lengths(16, 64), Lengths(8, 8),
                                                    seed=args.seed + 99), vocab)
            asyncio.run(run_load(url, model, warm, math.inf, "poisson", 1.0, None, 0, True, progress=False))
            report["systems"][name] = []
            if args.structured_compare:
                from services.bench.serve.structured_cost import compare

                report["structured_cost"] = {name: [compare(url, model, spec, vocab, r, args, slo, guided_counters,
                                                            mask_cost) for r in rates]}
                continue
            for rate, requests in zip(rates, workloads, strict=True):
                before, spec_before = guided_counters(url), spec_counters(url)
                results, duration = asyncio.run(run_load(url, model, requests, rate, args.arrival, args.burstiness,
                                                         args.concurrency, args.seed, not args.no_ignore_eos))
                summary = summarize(results, duration, slo)
                summary["rate"] = rate
                summary["structured"] = mask_cost(before, guided_counters(url))
                summary["spec_decode"] = spec_summary(spec_before, spec_counters(url))
                if summary["structured"]:
                    print(f"  structured: {summary['structured']}", flush=True)
                if summary["spec_decode"]:
                    print(f"  speculative decoding: {summary['spec_decode']}", flush=True)
                report["systems"][name].append(summary)
                print(_row(name, rate, summary), flush=True)
        finally:
            if server is not None:
                server.stop()
    print("\n" + TABLE_HEAD)
    for name, runs in report["systems"].items():
        for s in runs:
            print(_row(name, s["rate"], s))
    for name, runs in report["systems"].items():
        for s in runs:
            if s.get("spec_decode"):
                d = s["spec_decode"]
                print(f"{name} at rate {s['rate']:g}: acceptance rate {d['acceptance_rate']}, mean acceptance "
                      f"length {d['mean_acceptance_length']} ({d['draft_tokens']} draft tokens)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        from services.bench.serve.plot import plot_report

        plot_report(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0
