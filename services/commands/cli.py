"""The `pagedserve` command: one subcommand per service plus generate and bench.

Parsers are built from `services.commands.settings` (the one source of truth for flags and env vars); each
subcommand's implementation is imported only when it runs, so `pagedserve router` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from services.commands import settings as S

# subcommand -> (handler "module:function", options, default port or None, help)
_SERVICES = {
    "serve": ("services.commands.serve:run", S.SERVE_OPTIONS, S.DEFAULT_PORTS["serve"],
              "router + scheduler + engine in one process (no Redis needed)"),
    "engine": ("services.commands.engine:run", S.ENGINE_OPTIONS, S.DEFAULT_PORTS["engine"],
               "the engine service: model weights + KV cache, step protocol over TCP"),
    "scheduler": ("services.commands.scheduler:run", S.SCHEDULER_OPTIONS, S.DEFAULT_PORTS["scheduler"],
                  "the scheduler service: continuous batching + OpenAI API for one engine"),
    "router": ("services.commands.router:run", S.ROUTER_OPTIONS, S.DEFAULT_PORTS["router"],
               "the router: public OpenAI endpoint, prefix-aware routing over Redis"),
}


def _add_engine_worker(sub) -> None:
    p = sub.add_parser("engine-worker", help="one tensor-parallel rank other than 0 (started by the engine, or "
                       "on another machine of a group that spans machines)")
    S.add_options(p, S.ENGINE_WORKER_OPTIONS, None)
    p.set_defaults(handler="services.commands.engine_worker:run")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline from a prompt")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched together)")
    p.add_argument("--model", default=None, help="Hugging Face directory or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(handler="services.commands.generate:run")


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="local cluster: redis-server, N scheduler+engine replicas and a router")
    # Engines are processes in `up`; --model is its own (repeatable) flag here.
    own = tuple(o for o in S.SERVE_OPTIONS if o not in (S.IN_PROCESS_ENGINE, S.MODEL))
    S.add_options(p, own + (S.REDIS_URL, S.POLICY, S.MAX_QUEUE), S.DEFAULT_PORTS["router"])
    p.add_argument("--model", action="append", default=None,
                   help="a model to serve: PATH (Hugging Face directory or .gguf; default: the bundled SmolLM2), "
                   "or, repeated, NAME=PATH or NAME=PATH:REPLICAS for several models behind the routers "
                   f"(env {S.MODEL.env}: one PATH, which the replicas read themselves)")
    p.add_argument("--replicas", type=int, default=2, help="scheduler+engine replicas to start (per model)")
    p.add_argument("--routers", type=int, default=1, help="router processes to start (ports port, port+1, ...)")
    p.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                   help="start a local Redis Cluster of N shards (+1 replica each) instead of one redis-server")
    p.set_defaults(handler="services.commands.up:run")


def _add_pod_tools(sub) -> None:
    """Commands the Helm chart runs beside the services: model conversion, probes, preStop hooks."""
    c = sub.add_parser("convert", help="convert a GGUF model once into a safetensors directory (or its tokenizer)")
    c.add_argument("--model", default=None, help="a .gguf file or a directory holding one (default: bundled SmolLM2)")
    c.add_argument("--output", required=True, help="directory to write (a converted one is kept as it is)")
    c.add_argument("--tokenizer-only", action="store_true",
                   help="tokenizer, chat template and config only: what the router and scheduler read")
    c.add_argument("--log-level", default="info", choices=S.LOG_LEVEL.choices)
    c.set_defaults(handler="services.commands.convert:run")
    p = sub.add_parser("probe", help="health probes for Kubernetes exec probes (exit 0: healthy)")
    psub = p.add_subparsers(dest="probe_target", required=True)
    e = psub.add_parser("engine", help="a `health` round trip on the engine's step protocol")
    e.add_argument("--engine", default=S.ENGINE_URL.default, help="engine step endpoint")
    e.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    e.add_argument("--internal-token-file", default=None,
                   help="the engine's internal token (only an engine bound beyond loopback requires one)")
    e.set_defaults(handler="services.commands.probe:run")
    w = sub.add_parser("wait-for-disconnect", help="preStop hook: wait until no client is connected to the engine")
    w.add_argument("--engine", default=S.ENGINE_URL.default, help="the engine's listening address")
    w.add_argument("--timeout", type=float, required=True, help="seconds to wait at most")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between checks")
    w.set_defaults(handler="services.commands.prestop:run")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_kind", required=True)
    t = bsub.add_parser("throughput", help="offline throughput against transformers and vLLM")
    t.add_argument("--workload", default="w1", choices=("w1", "w2", "w3", "all"),
                   help="all: W1, W2 and W3 in one run (the command offline performance figures quote)")
    t.add_argument("--repeats", type=int, default=1,
                   help="runs of each workload, alternating the systems run by run; medians and ranges reported")
    t.add_argument("--profile", action="store_true",
                   help="also a profiled run per workload: where each step's time goes (and vLLM's own metrics)")
    t.add_argument("--against", default="transformers,vllm",
                   help="comma-separated baselines: transformers, vllm (or 'none')")
    t.add_argument("--model", default=None)
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--scale", type=float, default=1.0, help="multiply the number of requests (quick runs)")
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    t.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks pagedserve's engine is split across")
    t.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON here")
    t.add_argument("--lora-adapters", default=None,
                   help="comma-separated counts of rank-8 LoRA adapters in the mix, e.g. 0,1,4: throughput of each "
                        "and its ratio to the base model (0) in the same run, instead of the baselines")
    t.add_argument("--lora-passes", type=int, default=2,
                   help="with --lora-adapters: passes over the counts, alternately in order and reversed")
    t.set_defaults(handler="services.bench.offline.throughput:run")
    ba = bsub.add_parser("before-after", help="bench throughput of this checkout against an earlier revision's, "
                         "alternating runs in one command, ratio of medians")
    ba.add_argument("--before", required=True, help="the earlier git revision (checked out in a temporary worktree)")
    ba.add_argument("--runs", type=int, default=3, help="alternating runs of each")
    ba.add_argument("--json", dest="json_path", default=None)
    ba.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `bench throughput` arguments")
    ba.set_defaults(handler="services.bench.offline.before_after:run")
    gd = bsub.add_parser("guard", help="the default path's cost per step (scheduler with the null executor, engine "
                         "on a tiny model, W1 and W3 shapes) against references in the same run; exits 1 past a budget")
    gd.add_argument("--repeats", type=int, default=5)
    gd.add_argument("--inject", default="none", choices=("none", "scheduler", "engine"),
                    help="add a per-step cost on purpose, to see the guard fail on it")
    gd.add_argument("--json", dest="json_path", default=None)
    gd.set_defaults(handler="services.bench.offline.default_path_guard:run")
    r = bsub.add_parser("routing", help="prefix routing vs round-robin on local clusters, shared-prefix chat")
    r.add_argument("--replicas", type=int, default=3)
    r.add_argument("--groups", type=int, default=8, help="distinct system prompts")
    r.add_argument("--questions", type=int, default=12, help="user questions per system prompt")
    r.add_argument("--system-tokens", type=int, default=400, help="approximate system prompt length")
    r.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    r.add_argument("--max-tokens", type=int, default=8)
    r.add_argument("--model", default=None)
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--kv-cache-memory", default="256M", help="per replica")
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--port", type=int, default=8000, help="router port of the clusters")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(handler="services.bench.fleet.routing:run_routing")
    s = bsub.add_parser("serve", help="online serving through HTTP: rate sweeps, TTFT/TPOT/ITL, goodput; "
                        "against any endpoint, pagedserve's servers and vLLM's")
    s.add_argument("--endpoint", default=None, help="an OpenAI-compatible server to measure, e.g. http://host:8000")
    s.add_argument("--systems", default=None, help="pagedserve servers to start and measure: serve, up")
    s.add_argument("--against", default=None, choices=("vllm",), help="also start and measure vLLM's server")
    s.add_argument("--model", default=None)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    s.add_argument("--kv-cache-memory", default="2G", help="KV cache of every started server")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--workload", default="random", choices=("random", "chat", "shared-prefix", "multi-turn"))
    s.add_argument("--num-requests", type=int, default=64, help="requests per rate (sessions for multi-turn)")
    s.add_argument("--input-len", default="32-512", help="prompt tokens: N or LOW-HIGH")
    s.add_argument("--output-len", default="16-256", help="output tokens: N or LOW-HIGH")
    s.add_argument("--prefix-len", type=int, default=384, help="shared-prefix: tokens each group shares")
    s.add_argument("--groups", type=int, default=8, help="shared-prefix groups")
    s.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    s.add_argument("--rates", default="1,2,4", help="request rates to sweep (req/s; 'inf' sends all at once)")
    s.add_argument("--arrival", default="poisson", choices=("poisson", "gamma", "concurrency"))
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: < 1 burstier than Poisson")
    s.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    s.add_argument("--slo", default="ttft=500ms,tpot=100ms", help="goodput counts requests meeting it")
    s.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore it)")
    s.add_argument("--structured", type=float, default=0.0,
                   help="share of requests (0-1) constrained to a JSON schema (response_format json_schema)")
    s.add_argument("--warmup", type=int, default=8, help="requests sent to each server before measuring")
    s.add_argument("--lora-adapters", default=None,
                   help="comma-separated counts of rank-8 LoRA adapters in the mix, e.g. 0,1,4: starts one `pagedserve "
                        "serve` with them and gives each count's throughput and its ratio to the base model (0)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--log-dir", default=None, help="where started servers' logs go (default .bench/logs)")
    s.add_argument("--json", dest="json_path", default=None)
    s.add_argument("--plot", default=None, help="write latency-vs-rate and CDF plots to this PNG (matplotlib)")
    s.set_defaults(handler="services.bench.serve.run:run")
    g = bsub.add_parser("structured", help="mixed structured-output requests with the openai client against an "
                        "endpoint, every answer parsed and validated")
    g.add_argument("--endpoint", required=True, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument("--num-requests", type=int, default=200)
    g.add_argument("--concurrency", type=int, default=16)
    g.add_argument("--max-tokens", type=int, default=256)
    g.set_defaults(handler="services.bench.serve.structured_check:run")
    c = bsub.add_parser("chaos", help="faults under load on a local cluster: engine kill, Redis outage, dropped "
                        "streams, scheduler drain, overload burst")
    c.add_argument("--model", default=None)
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    c.add_argument("--replicas", type=int, default=2)
    c.add_argument("--streams", type=int, default=16, help="streams in flight when the engine is killed")
    c.add_argument("--redis-outage", type=float, default=20.0, help="seconds Redis stays stopped")
    c.add_argument("--dropped", type=int, default=200, help="clients that drop their stream after one token")
    c.add_argument("--burst", type=int, default=600, help="requests sent at once")
    c.add_argument("--scenarios", default=None, help="comma-separated subset of: engine-kill, redis-outage, "
                   "dropped-streams, drain, overload")
    c.add_argument("--json", dest="json_path", default=None)
    c.set_defaults(handler="services.bench.fleet.chaos:run")
    _add_bench_paper(bsub)
    x = bsub.add_parser("index", help="the prefix index under a simulated fleet: cost per decision against N")
    x.add_argument("--replicas", default="10,100,1000", help="comma-separated fleet sizes")
    x.add_argument("--redis-cluster", type=int, default=0, help="run on a local cluster of this many shards")
    x.add_argument("--cached-blocks", type=int, default=1000, help="background blocks each replica caches")
    x.add_argument("--capacity", type=int, default=4000, help="blocks a replica's cache holds")
    x.add_argument("--groups-per-replica", type=int, default=1, help="system prompts per replica")
    x.add_argument("--questions", type=int, default=10, help="requests per system prompt")
    x.add_argument("--min-decisions", type=int, default=10_000,
                   help="decisions per fleet size at least (small fleets run more rounds of fresh groups): the "
                        "default, one round at 1,000 replicas, gives every size the same number of prompts, so "
                        "the index holds as many keys of them whatever the fleet size")
    x.add_argument("--hold", type=int, default=0, help="decisions a request stays in flight (0: 2 x replicas)")
    x.add_argument("--publish-every", type=int, default=10, help="decisions between two event publishes")
    x.add_argument("--event-seconds", type=float, default=3.0, help="length of the event-rate phase")
    x.add_argument("--event-scale", type=float, default=1.0,
                   help="fraction of the H200 event rate (2,000 block events/s per replica) to generate")
    x.add_argument("--passes", type=int, default=1, choices=range(1, 21), metavar="1..20",
                   help="runs of every size, in alternating order; each figure is their median")
    x.add_argument("--replay-seconds", type=float, default=1.0,
                   help="seconds of the fleet's index writes at the H200 rate, recorded then sent at once (0: skip)")
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--json", dest="json_path", default=None)
    x.add_argument("--plot", default=None, help="PNG of cost per decision against fleet size")
    x.set_defaults(handler="services.bench.index.run:run")
    o = bsub.add_parser("router-overhead", help="median time the router adds between client and scheduler")
    o.add_argument("--requests", type=int, default=500)
    o.set_defaults(handler="services.bench.fleet.routing:run_overhead")


def _add_bench_paper(bsub) -> None:
    q = bsub.add_parser("paper", help="the Orca and vLLM papers' baselines (request-level, Orca-Max/Pow2/Oracle) "
                        "against pagedserve on one engine: KV memory breakdown, latency vs rate, sharing savings")
    q.add_argument("--model", default=None)
    q.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    q.add_argument("--workloads", default="sharegpt,alpaca", help="comma-separated: sharegpt, alpaca")
    q.add_argument("--systems", default="pagedserve,orca-oracle,orca-pow2,orca-max,request-level",
                   help="comma-separated serving systems (pagedserve first: the bound and rates derive from it)")
    q.add_argument("--scale-sharegpt", type=float, default=0.125,
                   help="ShareGPT lengths, maximum sequence length and pool times this")
    q.add_argument("--scale-alpaca", type=float, default=0.5, help="the same for Alpaca")
    q.add_argument("--num-requests", type=int, default=200,
                   help="requests per rate: enough that the queue, not the trace, decides how full the pool gets")
    q.add_argument("--fractions", default="0.125,0.25,0.5,1,2,4",
                   help="swept rates, as fractions of pagedserve's measured capacity (all requests at once)")
    q.add_argument("--bound-factor", type=float, default=2.0,
                   help="latency bound: this times pagedserve's normalized latency at the lowest rate")
    q.add_argument("--sharing-requests", type=int, default=8, help="requests of the sharing runs (0: skip)")
    q.add_argument("--sharing-pool-blocks", type=int, default=640)
    q.add_argument("--block-size", type=int, default=16)
    q.add_argument("--max-num-seqs", type=int, default=256)
    q.add_argument("--max-num-batched-tokens", type=int, default=2048)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--step-cost", default="cpu", choices=("cpu", "a100-opt13b"),
                   help="what a step costs on the virtual clock: measured here, or modeled for the paper's OPT-13B on "
                        "an A100 (the real engine still runs every step)")
    q.add_argument("--threads", type=int, default=1,
                   help="torch threads; at 1 each step is timed on CPU time, which other processes' load does not "
                        "inflate (0: torch's default, timed on wall time)")
    q.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON here")
    q.add_argument("--plot", default=None, help="write the figures to this PNG (matplotlib)")
    q.set_defaults(handler="services.bench.paper.run:run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (handler, options, port, help_text) in _SERVICES.items():
        p = sub.add_parser(name, help=help_text)
        S.add_options(p, options, port)
        p.set_defaults(handler=handler)
    _add_engine_worker(sub)
    _add_up(sub)
    _add_pod_tools(sub)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def _pin_threads() -> None:
    # Keep each OpenMP worker on its own core: on small VMs migrating threads cost a few percent of
    # throughput (measured 2.5% on W1). Must happen before torch loads its OpenMP runtime; an
    # operator's own settings win.
    import os

    os.environ.setdefault("OMP_PROC_BIND", "close")
    os.environ.setdefault("OMP_PLACES", "cores")


def main(argv: list[str] | None = None) -> int:
    _pin_threads()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: per-request noise (and cost) on the router's hot path.
    for noisy in ("httpx", "httpx2"):  # openai's client logs through "httpx2"
        logging.getLogger(noisy).setLevel(logging.WARNING)
    module_name, func_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
