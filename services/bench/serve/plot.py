"""Plots of a `bench serve` report: latency against request rate, and TTFT/TPOT distributions (CDFs)
at the highest rate, one line per system."""

from __future__ import annotations

import math


def plot_report(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, runs in report["systems"].items():
        finite = [r for r in runs if not math.isinf(r["rate"])]
        rates = [r["rate"] for r in finite]
        for ax, metric in ((axes[0][0], "ttft_s"), (axes[0][1], "tpot_s")):
            for pct, style in (("p50", "-"), ("p99", "--")):
                values = [(r[metric][pct] or float("nan")) * 1000 for r in finite]
                ax.plot(rates, values, style, marker="o", label=f"{name} {pct}")
        last = runs[-1]
        for ax, key in ((axes[1][0], "ttft_samples"), (axes[1][1], "tpot_samples")):
            xs = [v * 1000 for v in last[key]]
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} @ {last['rate']:g} req/s")
    for ax, title, xlabel in ((axes[0][0], "TTFT vs rate", "request rate (req/s)"),
                              (axes[0][1], "TPOT vs rate", "request rate (req/s)"),
                              (axes[1][0], "TTFT distribution (highest rate)", "TTFT (ms)"),
                              (axes[1][1], "TPOT distribution (highest rate)", "TPOT (ms)")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms" if "rate" in xlabel else "fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    w = report["workload"]
    fig.suptitle(f"pagedserve bench serve: {w['name']} workload, {w['num_requests']} requests, "
                 f"{report['arrival']} arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
