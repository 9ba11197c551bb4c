"""`pagedserve bench paper` end to end on a tiny random Llama (the real engine path), at tiny sizes: every
system's sustained rate searched on both workloads, the JSON under the issue's names with every figure on
the clock named by its kind, each ratio as the interval of its brackets, the plot, sharing."""

from __future__ import annotations

import json

from services.bench.paper.serve import RunResult
from services.commands.cli import main

SYSTEMS = ("request-level", "orca-max", "orca-pow2", "orca-oracle", "pagedserve")
PARTS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")


def test_bench_paper_searches_every_system_on_both_workloads(tiny_llama_dir, tmp_path, capsys):
    out, png = tmp_path / "paper.json", tmp_path / "paper.png"
    rc = main(["bench", "paper", "--model", str(tiny_llama_dir), "--dtype", "float32", "--trace-requests", "12",
               "--min-requests", "8", "--bracket", "1.5", "--scale-sharegpt", "0.0625", "--scale-alpaca", "0.25",
               "--sharing-requests", "1", "--threads", "1", "--sharing-pool-blocks", "96",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["clock"] == {"kind": "measured", "name": "measured: CPU time (1 torch thread)"}
    assert set(report["systems"]) == set(SYSTEMS)
    for workload in ("sharegpt", "alpaca"):
        d = report["workloads"][workload]
        assert d["clock"] == "measured" and d["measured_latency_bound_s_per_token"] > 0
        assert not any(k.startswith("modeled") for k in d)  # a measured run names nothing as modeled
        for system in SYSTEMS:
            entry = report["systems"][system][workload]
            assert all(0 <= entry[k] <= 100 for k in PARTS) and sum(entry[k] for k in PARTS) <= 100.01
            b = entry["measured_sustained_rps"]
            trials = d["systems"][system]["trials"]
            assert len(trials) == len(b["trials"]) >= 2
            assert all("measured_rate" in t and "measured_window_latency" in t and "rate" not in t for t in trials)
            # The bracket is made of runs: its ends are rates that were tried, with those outcomes.
            tried = {t["rate"]: t["sustained"] for t in b["trials"]}
            assert b["passed"] is None or tried[b["passed"]] is True
            assert b["failed"] is None or tried[b["failed"]] is False
            if b["passed"] and b["failed"]:
                assert b["failed"] / b["passed"] <= 1.5 * 1.001
            # Traces as long in time at every rate (at least --min-requests): more requests at higher rates.
            by_rate = sorted(trials, key=lambda t: t["measured_rate"])
            assert all(t["requests"] >= 8 for t in by_rate)
            assert by_rate[-1]["requests"] >= by_rate[0]["requests"]
        ratio = report["sustained_rate_ratios"][workload]["pagedserve/orca-max"]
        assert set(ratio) == {"low", "high", "text"} and ratio["text"].endswith("x")
        by = report["systems"]
        # Reservations hold memory nothing writes; paged blocks at most the end of each last block.
        assert by["orca-max"][workload]["internal_fragmentation"] > by["pagedserve"][workload]["internal_fragmentation"]
        assert by["pagedserve"][workload]["external_fragmentation"] == 0
    par = report["sharing"]["parallel_sampling"]
    assert set(par) == {"2", "4", "6"} and all(0 <= v < 100 for v in par.values())
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "| figure | paper | here (measured clock) | what differs |" in printed
    assert "sharegpt pagedserve" in printed and "requests," in printed  # a progress line per system and rate


def _result(**kw) -> RunResult:
    base = dict(rate=10.0, requests=100, trace_seconds=10.0, normalized_latency=0.01, window_latency=0.01,
                third_quarter_latency=0.01, last_quarter_latency=0.01, third_quarter_in_system=10.0,
                last_quarter_in_system=10.0, mean_latency=0.5, throughput=10.0, output_tokens_per_s=400.0,
                busy_seconds=8.0, max_running=12, preemptions=0)
    return RunResult(**{**base, **kw})


def test_a_rate_is_sustained_only_in_a_steady_state_within_the_bound():
    assert _result().verdict(0.02) == (True, "steady and within the bound")
    ok, why = _result(window_latency=0.03).verdict(0.02)
    assert not ok and "second-half latency" in why
    # Within the bound so far, but the queue still grows: not a steady state.
    ok, why = _result(third_quarter_in_system=20.0, last_quarter_in_system=30.0).verdict(0.02)
    assert not ok and "queue still growing" in why
    assert _result(third_quarter_in_system=1.0, last_quarter_in_system=3.0).verdict(0.02)[0]  # small counts
    # Every figure on the clock is written under the clock's kind.
    d = _result().as_dict("modeled")
    assert d["modeled_rate"] == 10.0 and d["modeled_window_latency"] == 0.01 and d["requests"] == 100
    assert "rate" not in d and "measured_rate" not in d
