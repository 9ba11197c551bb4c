"""`pagedserve bench paper` end to end on a tiny random Llama (the real engine path), at tiny sizes: every
system over a two-rate sweep of both workloads, the JSON under the issue's names, the plot, sharing."""

from __future__ import annotations

import json

from services.bench.paper.run import requests_at
from services.commands.cli import main

SYSTEMS = ("request-level", "orca-max", "orca-pow2", "orca-oracle", "pagedserve")
PARTS = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")


def test_bench_paper_reports_every_system_on_both_workloads(tiny_llama_dir, tmp_path, capsys):
    out, png = tmp_path / "paper.json", tmp_path / "paper.png"
    rc = main(["bench", "paper", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-requests", "6",
               "--fractions", "0.5,2", "--scale-sharegpt", "0.0625", "--scale-alpaca", "0.25",
               "--sharing-requests", "1", "--threads", "1", "--sharing-pool-blocks", "96",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == set(SYSTEMS)
    for system in SYSTEMS:
        for workload in ("sharegpt", "alpaca"):
            entry = report["systems"][system][workload]
            assert all(0 <= entry[k] <= 100 for k in PARTS) and sum(entry[k] for k in PARTS) <= 100.01
            assert entry["sustained_rate"] >= 0
    for workload in ("sharegpt", "alpaca"):
        by = report["systems"]
        # Reservations hold memory nothing writes; paged blocks at most the end of each last block.
        assert by["orca-max"][workload]["internal_fragmentation"] > by["pagedserve"][workload]["internal_fragmentation"]
        assert by["pagedserve"][workload]["external_fragmentation"] == 0
        sweep = report["workloads"][workload]["systems"]["pagedserve"]["sweep"]
        assert [p["rate"] for p in sweep] == report["workloads"][workload]["rates"]
    par = report["sharing"]["parallel_sampling"]
    assert set(par) == {"2", "4", "6"} and all(0 <= v < 100 for v in par.values())
    assert report["step_cost"] == "measured: CPU time (1 torch thread)"  # others' load does not inflate a step
    assert all(p["requests"] == 6 for p in sweep)
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "| figure | paper | measured here | what differs |" in printed


def test_low_rates_serve_fewer_requests_and_never_fewer_than_fifty():
    # Below capacity nothing queues: 50 requests show the latency; at capacity and above all of them run.
    assert [requests_at(200, f) for f in (0.125, 0.25, 0.5, 1, 4)] == [50, 50, 100, 200, 200]
    assert requests_at(6, 0.125) == 6
