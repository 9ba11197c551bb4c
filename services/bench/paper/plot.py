"""The plot of a `bench paper` report: normalized latency against rate per workload, every trial of the
search (the vLLM paper's Figure 12; filled markers sustained, hollow not, the bracket's ends joined), the
KV memory breakdown at the busiest step (its Figure 2), and the memory saved by sharing (its Figure 15).
Titles and axes name the clock (measured or modeled) the rates and latencies are on."""

from __future__ import annotations

PARTS = (("token_states", "token states", "#4c72b0"), ("reserved", "reserved", "#55a868"),
         ("internal_fragmentation", "internal fragmentation", "#dd8452"),
         ("external_fragmentation", "external fragmentation", "#c44e52"))


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    kind = report["clock"]["kind"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for ax, (name, d) in zip(axes[0], workloads.items(), strict=False):
        bound = d[f"{kind}_latency_bound_s_per_token"]
        top = 0.0
        for system, entry in d["systems"].items():
            pts = sorted(entry["trials"], key=lambda p: p[f"{kind}_rate"])
            xs = [p[f"{kind}_rate"] for p in pts]
            ys = [p[f"{kind}_window_latency"] for p in pts]
            top = max([top, *ys])
            line = ax.plot(xs, ys, linestyle=":", alpha=0.5)[0]
            color = line.get_color()
            ok = [p["sustained"] for p in pts]
            ax.scatter([x for x, o in zip(xs, ok, strict=True) if o], [y for y, o in zip(ys, ok, strict=True) if o],
                       color=color, label=f"{system}: {entry['sustained']}")
            ax.scatter([x for x, o in zip(xs, ok, strict=True) if not o],
                       [y for y, o in zip(ys, ok, strict=True) if not o], facecolors="none", edgecolors=color)
        ax.axhline(bound, color="grey", linestyle="--", label="latency bound")
        ax.set_xscale("log")
        ax.set_ylim(0, min(top * 1.05, bound * 3))
        ax.set_title(f"{name}-like (x{d['scale']} lengths), {kind} clock", fontsize=10)
        ax.set_xlabel(f"request rate (req/s of the {kind} clock)")
        ax.set_ylabel(f"normalized latency, 2nd half (s/token, {kind})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    ax = axes[1][0]
    labels, bottoms = [], []
    bars = {key: [] for key, _, _ in PARTS}
    for name, d in workloads.items():
        for system, entry in d["systems"].items():
            labels.append(f"{system}\n{name}")
            for key, _, _ in PARTS:
                bars[key].append(entry[key])
    bottoms = [0.0] * len(labels)
    for key, label, color in PARTS:
        ax.bar(range(len(labels)), bars[key], bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, bars[key], strict=True)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=60)
    ax.set_ylabel("% of the KV pool")
    ax.set_ylim(0, 100)
    ax.set_title("KV memory at the busiest step")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    share = report.get("sharing", {})
    if share:
        widths = ["2", "4", "6"]
        for i, (key, label) in enumerate((("parallel_sampling", "parallel sampling (n)"),
                                          ("beam_search", "beam search (width)"))):
            values = [share.get(key, {}).get(k, 0.0) for k in widths]
            ax.bar([j + 0.4 * i for j in range(len(widths))], values, width=0.4, label=label)
        ax.set_xticks([j + 0.2 for j in range(len(widths))], widths)
        ax.set_xlabel("samples or beams per request")
        ax.set_ylabel("% of blocks saved by sharing")
        ax.set_title(f"memory saved by sharing ({share['workload']}, counted)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    else:
        ax.text(0.5, 0.5, "sharing not run (--sharing-requests 0)", ha="center", va="center")
        ax.set_axis_off()
    fig.suptitle(f"pagedserve bench paper, {report['clock']['name']}\n"
                 f"steps run: {report['model']} ({report['dtype']}) on {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
