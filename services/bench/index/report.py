"""What `pagedserve bench index` prints, keeps and draws: one line per fleet size, medians over passes, the
cost-against-N plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace


@dataclass
class FleetResult:
    replicas: int
    decisions: int
    decision_p50_ms: float
    decision_p99_ms: float
    redis_us_per_decision: float
    router_us_per_decision: float
    decisions_per_s_per_redis_core: float
    oracle_fraction: float
    busiest_vs_fair: float
    redis_bytes_per_cached_block: float
    events_per_s_target: float
    events_per_s_absorbed: float
    redis_us_per_event: float
    redis_by_command: dict[str, dict[str, float]]
    replay: dict | None  # index_replay.ReplayResult: the fleet's writes at the H200 rate, sent at once
    write_load: dict | None = None  # write_load.WriteStats: the fleet's writes during the decisions
    redis_busy_fraction: float = 0.0  # Redis CPU over the decision phase's wall time (decisions, writes, publishes)
    whole_fleet_decisions: dict = field(default_factory=dict)  # "session"/"lora" -> p50_ms, p99_ms, decisions
    runs_decision_p99_ms: list[float] = field(default_factory=list)  # each pass's, when there were several
    runs_redis_us_per_decision: list[float] = field(default_factory=list)


def print_result(r: FleetResult) -> None:
    print(f"  {r.replicas:>5} replicas: decision p50 {r.decision_p50_ms:6.2f} ms p99 {r.decision_p99_ms:6.2f} ms | "
          f"Redis {r.redis_us_per_decision:6.1f} us/decision (~{r.decisions_per_s_per_redis_core:,.0f}/s per "
          f"core) | router CPU {r.router_us_per_decision:6.0f} us | oracle {r.oracle_fraction:.1%} | busiest "
          f"{r.busiest_vs_fair:.2f}x fair | {r.redis_bytes_per_cached_block:.0f} B/block | events "
          f"{r.events_per_s_absorbed:,.0f}/s of {r.events_per_s_target:,.0f}/s target, "
          f"{r.redis_us_per_event:.2f} us each", flush=True)
    if r.write_load:
        w = r.write_load
        print(f"         while the fleet wrote {w['events_per_s']:,.0f} block events/s ({w['writes_per_s']:,.0f} index "
              f"writes/s; target {w['target_events_per_s']:,.0f}/s) from its own process(es); Redis "
              f"{r.redis_busy_fraction:.0%} busy", flush=True)
    for kind, d in r.whole_fleet_decisions.items():
        print(f"         {kind} decisions (the whole fleet ranked): p50 {d['p50_ms']:.2f} ms p99 {d['p99_ms']:.2f} ms "
              f"({d['decisions']})", flush=True)
    if r.replay:
        p = r.replay
        print(f"         H200 rate, replayed: {p['seconds_of_fleet_time']:g} s of the fleet's writes "
              f"({p['block_events']:,} block events, {p['index_writes']:,} index writes) applied in "
              f"{p['wall_s']:.2f} s: {p['writes_per_s']:,.0f} writes/s for {p['target_writes_per_s']:,.0f}/s "
              f"needed, {p['redis_us_per_write']:.2f} us each, busiest shard {p['busiest_shard_cpu_fraction']:.0%} "
              f"busy", flush=True)
    print("         Redis per decision: " + ", ".join(
        f"{k} {v['calls_per_decision']:g}x {v['us_per_decision']:.1f} us"
        for k, v in list(r.redis_by_command.items())[:6]), flush=True)


_MEDIAN_FIELDS = ("decision_p50_ms", "decision_p99_ms", "redis_us_per_decision", "router_us_per_decision",
                  "oracle_fraction", "busiest_vs_fair", "events_per_s_absorbed", "redis_us_per_event",
                  "redis_busy_fraction")


def median_result(runs: list[FleetResult]) -> FleetResult:
    """Each figure the median of the passes' (the per-command split and the replay: the first pass's)."""
    med = {f: statistics.median(getattr(r, f) for r in runs) for f in _MEDIAN_FIELDS}
    redis_us = med["redis_us_per_decision"]
    return replace(runs[0], **med, decisions_per_s_per_redis_core=1e6 / redis_us if redis_us else float("inf"),
                   runs_decision_p99_ms=[r.decision_p99_ms for r in runs],
                   runs_redis_us_per_decision=[r.redis_us_per_decision for r in runs])


def plot(results: list[FleetResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r.replicas for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ns, [r.decision_p99_ms * 1e3 for r in results], "o-", label="decision p99 (us)")
    ax.plot(ns, [r.decision_p50_ms * 1e3 for r in results], "o-", label="decision p50 (us)")
    ax.plot(ns, [r.redis_us_per_decision for r in results], "s-", label="Redis CPU per decision (us)")
    ax.plot(ns, [r.router_us_per_decision for r in results], "^-", label="router CPU per decision (us)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("microseconds")
    ax.set_title("prefix index: cost per routing decision against fleet size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
