"""`bench serve --structured-compare N`: what constrained decoding costs end to end, in one run.

Against one server, N pairs of passes of the same workload shape (fresh prompts every pass, so no pass is
served from another's prefix cache), each pair one pass with every request unconstrained and one with
every request held to STRUCTURED_SCHEMA (a JSON array too long to finish, so both run the same number of
tokens), the order alternating from pair to pair (A B, B A, ...) so a drift of the machine lands on both
alike. The figure is the ratio of the two conditions' median TPOT (p50 over a pass's requests, median
over passes), with every pass's figure and the ratio of each pair beside it: the whole cost of a mask
(computing it, sending it with the step, copying it to the device, the masked sampling), not only the
mask computation the server's own counters time (`mask_ms_per_step`, reported too).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace

from services.bench.serve.load import run_load
from services.bench.serve.metrics import summarize
from services.bench.serve.workloads import make_serve_workload


def compare(url: str, model: str, spec, vocab: int, rate: float, args, slo, counters, mask_cost) -> dict:
    """Alternating passes, unconstrained (0) and constrained (1); returns the per-pass and summary figures."""
    passes = []
    for p in range(2 * args.structured_compare):
        pair, second = divmod(p, 2)
        constrained = bool(second) != bool(pair % 2)  # A B, B A, A B, ...
        requests = make_serve_workload(replace(spec, seed=spec.seed + 7919 * (p + 1)), vocab)
        for r in requests:
            r.structured = constrained
        before = counters(url)
        results, duration = asyncio.run(run_load(url, model, requests, rate, args.arrival, args.burstiness,
                                                 args.concurrency, args.seed + p, not args.no_ignore_eos))
        s = summarize(results, duration, slo)
        entry = {"pair": pair, "constrained": constrained, "tpot_p50_ms": _ms(s["tpot_s"]["p50"]),
                 "tpot_p99_ms": _ms(s["tpot_s"]["p99"]), "ttft_p50_ms": _ms(s["ttft_s"]["p50"]),
                 "output_tok_s": round(s["output_throughput"], 1), "completed": s["completed"],
                 "requests": s["requests"], "mask": mask_cost(before, counters(url))}
        passes.append(entry)
        print(f"  pass {p + 1}/{2 * args.structured_compare} ({'constrained' if constrained else 'unconstrained'}): "
              f"TPOT p50 {entry['tpot_p50_ms']} ms, p99 {entry['tpot_p99_ms']} ms, {entry['completed']}/"
              f"{entry['requests']} completed" + (f"; {entry['mask']}" if entry["mask"] else ""), flush=True)
    on = [e["tpot_p50_ms"] for e in passes if e["constrained"]]
    off = [e["tpot_p50_ms"] for e in passes if not e["constrained"]]
    pairs = [round(a["tpot_p50_ms"] / b["tpot_p50_ms"], 3) for a, b in
             (_split(passes, k) for k in range(args.structured_compare))]
    out = {"rate": rate, "passes": passes, "tpot_p50_ms_unconstrained": off, "tpot_p50_ms_constrained": on,
           "ratio_of_medians": round(statistics.median(on) / statistics.median(off), 3),
           "ratio_per_pair": pairs, "ratio_spread": [min(pairs), max(pairs)]}
    print(f"  constrained / unconstrained TPOT p50: {out['ratio_of_medians']}x (medians of {len(on)} passes each; "
          f"per pair {', '.join(map(str, pairs))})", flush=True)
    return out


def _split(passes: list[dict], pair: int) -> tuple[dict, dict]:
    a, b = (e for e in passes if e["pair"] == pair)
    return (a, b) if a["constrained"] else (b, a)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
