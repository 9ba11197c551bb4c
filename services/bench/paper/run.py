"""`pagedserve bench paper`: the Orca and vLLM papers' comparisons, reproduced on pagedserve's own engine.

Five serving systems (services.scheduler.serving_system: request-level batching, Orca-Max/Pow2/Oracle,
pagedserve) serve the same seeded ShareGPT-like and Alpaca-like Poisson traces over a rate sweep on one
engine (same model, kernels and machine), one after another. Reported per system and workload: KV
memory at the busiest moment (token states, reserved, internal and external fragmentation, percent of
the pool), normalized latency against rate, and the highest rate sustained under the latency bound;
then memory saved by sharing for parallel sampling and beam search, and the papers' figures beside ours.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

from services.bench.paper.kv_breakdown import BusiestMoment
from services.bench.paper.serve import PoolView, serve_trace, sustained_rate
from services.bench.paper.sharing_savings import beam_search_saving, parallel_sampling_saving
from services.bench.paper.step_cost import make_step_cost
from services.bench.paper.workloads import DISTRIBUTIONS, WorkloadScale, poisson_trace
from services.commands.bench_flags import block_size, one_of, parsed, positive_numbers

SYSTEMS = ("request-level", "orca-max", "orca-pow2", "orca-oracle", "pagedserve")
SHARING_WIDTHS = (2, 4, 6)


def check_flags(args) -> None:
    """What `bench paper` refuses while its command line is parsed (services.commands.flag_rules)."""
    block_size(args)
    one_of(args, "workloads", tuple(DISTRIBUTIONS))
    one_of(args, "systems", SYSTEMS)
    parsed(args, "fractions", positive_numbers)


def requests_at(num_requests: int, fraction: float) -> int:
    """Requests served at a rate `fraction` of capacity: all of them from capacity up, where the queue and
    the pool fill; fewer below, where nothing queues and a run costs about requests / rate seconds."""
    return max(min(num_requests, 50), round(num_requests * min(1.0, fraction)))


def run_workload(llm, w: WorkloadScale, args, block_size: int) -> dict:
    """Every system over the rate sweep of one workload; rates are fractions of pagedserve's capacity."""
    import torch

    from services.scheduler.core import SchedulerCore

    vocab = llm.core.info.vocab_size

    def core_for(system: str) -> SchedulerCore:
        view = PoolView(llm.core.executor, w.pool_blocks(block_size), w.max_seq_len)
        return SchedulerCore(view, llm.tokenizer, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, serving_system=system)

    step_cost = make_step_cost(args.step_cost, torch.get_num_threads(), w.scale)
    all_at_once = poisson_trace(w, args.num_requests, math.inf, vocab, args.seed)
    capacity = serve_trace(core_for("pagedserve"), all_at_once, math.inf, step_cost=step_cost).throughput
    fractions = positive_numbers(args.fractions)
    rates = [round(f * capacity, 3) for f in fractions]
    print(f"\n{w.dist.name}: scale {w.scale}, max sequence {w.max_seq_len} tokens, pool {w.pool_blocks(block_size)} "
          f"blocks of {block_size}; pagedserve capacity {capacity:.2f} req/s; rates {rates}", flush=True)
    names = args.systems.split(",")
    busiest = {s: BusiestMoment() for s in names}
    sweeps: dict[str, list[dict]] = {s: [] for s in names}
    # Systems take turns at each rate, so a change in the machine's load lands on all of them alike.
    for f, rate in zip(fractions, rates, strict=True):
        count = requests_at(args.num_requests, f)
        for system in names:
            trace = poisson_trace(w, count, rate, vocab, args.seed, tag=f"{system}-{rate}-")
            res = serve_trace(core_for(system), trace, rate, on_step=busiest[system].observe, step_cost=step_cost)
            sweeps[system].append({**res.as_dict(), "requests": count})
            print(f"  {system:<14} rate {rate:>7.3f}: normalized latency {res.normalized_latency:.4f} s/token, "
                  f"{res.throughput:.2f} req/s served, max {res.max_running} running, {count} requests "
                  f"({res.busy_seconds:.1f} s)", flush=True)
    systems = {s: {**busiest[s].result().as_dict(), "sweep": sweeps[s]} for s in names}
    lowest = systems.get("pagedserve", next(iter(systems.values())))["sweep"][0]["normalized_latency"]
    bound = args.bound_factor * lowest
    for entry in systems.values():
        rate, capped = sustained_rate([(p["rate"], p["normalized_latency"]) for p in entry["sweep"]], bound)
        entry["sustained_rate"], entry["sustained_rate_is_lower_limit"] = round(rate, 3), capped
    return {"scale": w.scale, "max_seq_len": w.max_seq_len, "pool_blocks": w.pool_blocks(block_size),
            "mean_input_tokens": round(w.dist.mean_input * w.scale, 1),
            "mean_output_tokens": round(w.dist.mean_output * w.scale, 1), "num_requests": args.num_requests,
            "capacity_rps": round(capacity, 3), "rates": rates, "latency_bound_s_per_token": round(bound, 5),
            "systems": systems}


def sharing(llm, args) -> dict:
    """Memory saved by sharing, on the paper's Alpaca lengths unscaled (short enough to run here)."""
    w = WorkloadScale(DISTRIBUTIONS["alpaca"], 1.0)
    trace = poisson_trace(w, args.sharing_requests, math.inf, llm.core.info.vocab_size, args.seed + 7)
    par = {str(n): round(parallel_sampling_saving(llm, trace, n, args.seed), 2) for n in SHARING_WIDTHS}
    beam = {str(k): beam_search_saving(llm, trace, k) for k in SHARING_WIDTHS}
    beam = {k: round(v, 2) for k, v in beam.items() if v is not None}
    return {"workload": "alpaca (scale 1)", "requests": len(trace), "parallel_sampling": par, "beam_search": beam}


def ratio(a: dict, b: dict) -> str | None:
    """Sustained rate of `a` over `b`: ">=" when only a's is a lower limit (it sustained the whole sweep),
    "<=" when only b's is, ">" over the lowest swept rate when b was over the bound even there, None when
    both sustained the whole sweep (it reached neither limit)."""
    ra, rb = a["sustained_rate"], b["sustained_rate"]
    la, lb = a["sustained_rate_is_lower_limit"], b["sustained_rate_is_lower_limit"]
    if la and lb:
        return None
    if rb <= 0:
        return f">{ra / b['sweep'][0]['rate']:.2f}" if ra > 0 else None
    return (">=" if la else "<=" if lb else "") + f"{ra / rb:.2f}"


def summarize(report: dict) -> None:
    wl = report["workloads"]
    report["sustained_rate_ratios"] = {
        name: {f"pagedserve/{s}": ratio(d["systems"]["pagedserve"], d["systems"][s])
               for s in SYSTEMS if s != "pagedserve" and s in d["systems"]}
        for name, d in wl.items() if "pagedserve" in d["systems"]}
    report["request_vs_iteration_level"] = {
        name: {"request-level_rps": d["systems"]["request-level"]["sustained_rate"],
               "orca-max_rps": d["systems"]["orca-max"]["sustained_rate"],
               "iteration/request (same allocator)": ratio(d["systems"]["orca-max"], d["systems"]["request-level"])}
        for name, d in wl.items() if {"request-level", "orca-max"} <= d["systems"].keys()}
    # Flat view under the names the issue gives: systems -> workload -> breakdown and sustained rate.
    report["systems"] = {s: {name: {k: v for k, v in d["systems"][s].items() if k != "sweep"}
                             for name, d in wl.items() if s in d["systems"]} for s in SYSTEMS}


def run(args) -> int:
    import torch

    started = time.perf_counter()
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, started)
    finally:
        torch.set_num_threads(threads)


def _run(args, started: float) -> int:
    import torch

    from services import LLM
    from services.bench.paper.comparison import comparison_rows, print_report

    scales = {"sharegpt": args.scale_sharegpt, "alpaca": args.scale_alpaca}
    workloads = [WorkloadScale(DISTRIBUTIONS[n], scales[n]) for n in args.workloads.split(",")]
    pool = max([w.pool_blocks(args.block_size) for w in workloads] + [args.sharing_pool_blocks])
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=pool,
              max_model_len=max(w.max_seq_len for w in workloads + [WorkloadScale(DISTRIBUTIONS["alpaca"], 1.0)]),
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)
    # Warm-up outside any measurement: the first steps pick and build the CPU kernels.
    from services import SamplingParams

    llm.generate([[(7919 * i) % 40000 + 100 for i in range(48)]] * 4, SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    report = {"model": str(llm.runner.model_dir.name), "dtype": args.dtype, "block_size": args.block_size,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"{args.threads or 'default'} torch threads",
              "bound": f"{args.bound_factor} x pagedserve's normalized latency at the lowest swept rate",
              "step_cost": make_step_cost(args.step_cost, torch.get_num_threads(), 1.0).name,
              "workloads": {w.dist.name: run_workload(llm, w, args, args.block_size) for w in workloads}}
    if args.sharing_requests > 0:
        report["sharing"] = sharing(llm, args)
    llm.close()
    summarize(report)
    report["paper_comparison"] = comparison_rows(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print_report(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    if args.plot:
        from services.bench.paper.plot import plot

        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0
