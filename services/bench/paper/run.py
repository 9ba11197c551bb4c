"""`pagedserve bench paper`: the Orca and vLLM papers' comparisons, reproduced on pagedserve's own engine.

Five serving systems (services.scheduler.serving_system: request-level batching, Orca-Max/Pow2/Oracle,
pagedserve) serve the same seeded ShareGPT-like and Alpaca-like Poisson traces on one engine (same model,
kernels and machine). Per workload:

1. pagedserve's all-at-once throughput on `--trace-requests` requests (its capacity) sets the trace
   length for every run: `--trace-requests` / capacity seconds of the clock, so a trace is as long in
   time at every rate and for every system (more requests at higher rates; at least `--min-requests`);
2. the latency bound: `--bound-factor` x pagedserve's normalized latency at 1/8 of its capacity;
3. each system's sustained rate, searched (services.bench.paper.rate_search): doubled or halved from a
   start until one rate is sustained and one is not, then bisected until the bracket is within
   `--bracket` (10%); "sustained" is services.bench.paper.serve's steady-state test.

Reported per system and workload: the bracket and every trial, KV memory at the busiest step (token
states, reserved, internal and external fragmentation, percent of the pool), and each ratio of sustained
rates as the interval its two brackets allow; then memory saved by sharing for parallel sampling and
beam search, and the papers' figures beside ours. Every figure on the clock is named by its kind,
measured or modeled (services.bench.paper.step_cost).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from services.bench.host_cpu import describe_cpu
from services.bench.paper.kv_breakdown import BusiestMoment
from services.bench.paper.rate_search import Bracket, describe_ratio, find_sustained, ratio_bracket, trace_requests
from services.bench.paper.serve import PoolView, serve_trace
from services.bench.paper.sharing_savings import beam_search_saving, parallel_sampling_saving
from services.bench.paper.step_cost import make_step_cost
from services.bench.paper.workloads import DISTRIBUTIONS, WorkloadScale, poisson_trace
from services.commands.bench_flags import block_size, one_of

SYSTEMS = ("request-level", "orca-max", "orca-pow2", "orca-oracle", "pagedserve")
SHARING_WIDTHS = (2, 4, 6)
REFERENCE_FRACTION = 1 / 8  # of pagedserve's capacity: the light load the latency bound is taken at
SEARCH_SPAN = 64  # the search stays within capacity / SEARCH_SPAN .. capacity x SEARCH_SPAN


def check_flags(args) -> None:
    """What `bench paper` refuses while its command line is parsed (services.commands.flag_rules)."""
    block_size(args)
    one_of(args, "workloads", tuple(DISTRIBUTIONS))
    one_of(args, "systems", SYSTEMS)


class WorkloadRun:
    """One workload's runs: every trial of every system on one clock, with its progress lines."""

    def __init__(self, llm, w: WorkloadScale, args, step_cost, started: float):
        self.llm, self.w, self.args, self.clock, self.started = llm, w, args, step_cost, started
        self.vocab = llm.core.info.vocab_size
        self.names = args.systems.split(",")
        self.busiest = {s: BusiestMoment() for s in self.names}
        self.trials: dict[str, list[dict]] = {s: [] for s in self.names}
        self.seconds = self.bound = math.nan

    def core_for(self, system: str):
        from services.scheduler.core import SchedulerCore

        view = PoolView(self.llm.core.executor, self.w.pool_blocks(self.args.block_size), self.w.max_seq_len)
        return SchedulerCore(view, self.llm.tokenizer, max_num_seqs=self.args.max_num_seqs,
                             max_num_batched_tokens=self.args.max_num_batched_tokens, serving_system=system)

    def serve(self, system: str, rate: float, observe: bool = True):
        n = trace_requests(rate, self.seconds, self.args.min_requests)
        # The same seed at every rate and for every system: the same requests, only their arrivals differ.
        trace = poisson_trace(self.w, n, rate, self.vocab, self.args.seed, tag=f"{system}-{rate}-")
        return serve_trace(self.core_for(system), trace, rate, step_cost=self.clock,
                           on_step=self.busiest[system].observe if observe else None)

    def trial(self, system: str, rate: float) -> bool:
        res = self.serve(system, rate)
        ok, why = res.verdict(self.bound)
        kind = self.clock.kind
        self.trials[system].append({**res.as_dict(kind), "sustained": ok, "verdict": why})
        print(f"  {self.w.dist.name} {system:<13} rate {rate:>8.4g}/s ({res.requests:>4} requests, "
              f"{res.trace_seconds:6.1f} s of {kind} clock): 2nd-half latency {res.window_latency:.4g} s/token "
              f"(bound {self.bound:.4g}); in system {res.third_quarter_in_system:.1f} -> "
              f"{res.last_quarter_in_system:.1f}: {'sustained' if ok else 'NOT sustained: ' + why}  "
              f"[{time.perf_counter() - self.started:.0f} s]", flush=True)
        return ok

    def run(self) -> dict:
        w, args, kind = self.w, self.args, self.clock.kind
        first = "pagedserve" if "pagedserve" in self.names else self.names[0]
        all_at_once = poisson_trace(w, args.trace_requests, math.inf, self.vocab, args.seed)
        capacity = serve_trace(self.core_for(first), all_at_once, math.inf, step_cost=self.clock).throughput
        self.seconds = args.trace_requests / capacity
        reference = self.serve(first, capacity * REFERENCE_FRACTION, observe=False)
        self.bound = args.bound_factor * reference.window_latency
        print(f"\n{w.dist.name}: scale {w.scale}, max sequence {w.max_seq_len} tokens, pool "
              f"{w.pool_blocks(args.block_size)} blocks of {args.block_size}; {first} all at once "
              f"{capacity:.4g} req/s ({kind} clock); traces {self.seconds:.2f} s long; bound {self.bound:.4g} s/token "
              f"({args.bound_factor} x {reference.window_latency:.4g} at {reference.rate:.4g} req/s)", flush=True)
        brackets: dict[str, Bracket] = {}
        start = 0.7 * capacity  # pagedserve's all-at-once throughput overstates what it sustains
        for system in self.names:
            # Each search starts where the previous system's passed: the default order (pagedserve, oracle,
            # pow2, max, request-level) goes down in capacity, so most start within 2x of their own rate.
            brackets[system] = find_sustained(lambda r, s=system: self.trial(s, r), start,
                                              capacity / SEARCH_SPAN, capacity * SEARCH_SPAN, args.bracket)
            start = brackets[system].passed or start
        systems = {s: {**self.busiest[s].result().as_dict(), f"{kind}_sustained_rps": brackets[s].as_dict(),
                       "sustained": brackets[s].describe(), "trials": self.trials[s]} for s in self.names}
        return {"scale": w.scale, "max_seq_len": w.max_seq_len, "pool_blocks": w.pool_blocks(args.block_size),
                "mean_input_tokens": round(w.dist.mean_input * w.scale, 1),
                "mean_output_tokens": round(w.dist.mean_output * w.scale, 1), "clock": kind,
                f"{kind}_capacity_rps": round(capacity, 4), f"{kind}_trace_seconds": round(self.seconds, 4),
                "trace_requests_at_capacity": args.trace_requests, "min_requests": args.min_requests,
                f"{kind}_latency_bound_s_per_token": round(self.bound, 6),
                "reference": reference.as_dict(kind), "systems": systems, "_brackets": brackets}


def sharing(llm, args) -> dict:
    """Memory saved by sharing, on the paper's Alpaca lengths unscaled (short enough to run here)."""
    w = WorkloadScale(DISTRIBUTIONS["alpaca"], 1.0)
    trace = poisson_trace(w, args.sharing_requests, math.inf, llm.core.info.vocab_size, args.seed + 7)
    par = {str(n): round(parallel_sampling_saving(llm, trace, n, args.seed), 2) for n in SHARING_WIDTHS}
    beam = {str(k): beam_search_saving(llm, trace, k) for k in SHARING_WIDTHS}
    beam = {k: round(v, 2) for k, v in beam.items() if v is not None}
    return {"workload": "alpaca (scale 1)", "requests": len(trace), "parallel_sampling": par, "beam_search": beam}


def summarize(report: dict) -> None:
    """The ratios of sustained rates, each as the interval its two brackets allow, and a flat view."""
    wl = report["workloads"]
    ratios, iteration = {}, {}
    for name, d in wl.items():
        b = d.pop("_brackets")
        if "pagedserve" in b:
            ratios[name] = {f"pagedserve/{s}": {**ratio_bracket(b["pagedserve"], b[s]),
                                                "text": describe_ratio(ratio_bracket(b["pagedserve"], b[s]))}
                            for s in SYSTEMS if s != "pagedserve" and s in b}
        if {"request-level", "orca-max"} <= b.keys():
            r = ratio_bracket(b["orca-max"], b["request-level"])
            iteration[name] = {"orca-max/request-level": {**r, "text": describe_ratio(r)}}
    report["sustained_rate_ratios"] = ratios
    report["iteration_over_request_level"] = iteration
    report["systems"] = {s: {name: {k: v for k, v in d["systems"][s].items() if k != "trials"}
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

    from services import LLM, SamplingParams
    from services.bench.paper.comparison import comparison_rows, print_report

    model, dtype = args.model, args.dtype
    if model is None:
        from services.bench.paper.tiny_model import tiny_model_dir

        model, dtype = str(tiny_model_dir()), dtype or "float32"
        print(f"model: a 2-layer random Llama (hidden 64) in {dtype}, {model} (--model runs real weights)", flush=True)
    dtype = dtype or "bfloat16"
    scales = {"sharegpt": args.scale_sharegpt, "alpaca": args.scale_alpaca}
    workloads = [WorkloadScale(DISTRIBUTIONS[n], scales[n]) for n in args.workloads.split(",")]
    pool = max([w.pool_blocks(args.block_size) for w in workloads] + [args.sharing_pool_blocks])
    llm = LLM(model=model, dtype=dtype, block_size=args.block_size, num_kv_blocks=pool,
              max_model_len=max(w.max_seq_len for w in workloads + [WorkloadScale(DISTRIBUTIONS["alpaca"], 1.0)]),
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)
    # Warm-up outside any measurement: the first steps pick and build the CPU kernels.
    llm.generate([[(7919 * i) % 40000 + 100 for i in range(48)]] * 4, SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    clock = make_step_cost(args.step_cost, torch.get_num_threads(), 1.0)
    report = {"model": str(llm.runner.model_dir.name), "dtype": dtype, "block_size": args.block_size,
              "machine": f"{describe_cpu()}; {args.threads or 'default'} torch threads",
              "clock": {"kind": clock.kind, "name": clock.name},
              "bound": f"{args.bound_factor} x pagedserve's normalized latency at 1/8 of its capacity",
              "search": f"bisection until failed/passed <= {args.bracket}; traces {args.trace_requests} / capacity "
                        f"seconds long, at least {args.min_requests} requests",
              "workloads": {}}
    for w in workloads:
        step_cost = make_step_cost(args.step_cost, torch.get_num_threads(), w.scale)
        report["workloads"][w.dist.name] = WorkloadRun(llm, w, args, step_cost, started).run()
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
