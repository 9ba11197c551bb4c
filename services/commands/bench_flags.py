"""The `pagedserve bench` subcommands' flags, and what each refuses before a benchmark starts.

Counts, sizes and ports are checked by their types (services.commands.flag_values); the lists and
specs a benchmark parses itself (rates, lengths, SLOs, the systems and scenarios to run) are checked here
with the benchmark's own parser, so a bad one is one line from the argument parser, exit code 2.
"""

from __future__ import annotations

import argparse

from services.commands import flag_values as V
from services.commands import settings as S
from services.commands.flag_values import FlagError, flag
from services.registry.index_grid import DENSE, STRIDE


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_kind", required=True)
    t = bsub.add_parser("throughput", help="offline throughput against transformers and vLLM")
    t.add_argument("--workload", default="w1", choices=("w1", "w2", "w3", "all"),
                   help="all: W1, W2 and W3 in one run (the command offline performance figures quote)")
    t.add_argument("--repeats", type=V.integer(1), default=1,
                   help="runs of each workload, alternating the systems run by run; medians and ranges reported")
    t.add_argument("--profile", action="store_true",
                   help="also a profiled run per workload: where each step's time goes (and vLLM's own metrics)")
    t.add_argument("--against", default="transformers,vllm",
                   help="comma-separated baselines: transformers, vllm (or 'none')")
    t.add_argument("--model", default=None)
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--seed", type=V.integer(), default=0)
    t.add_argument("--scale", type=V.number(0, above=True), default=1.0,
                   help="multiply the number of requests (quick runs)")
    t.add_argument("--max-num-seqs", type=V.integer(1), default=256)
    t.add_argument("--max-num-batched-tokens", type=V.integer(1), default=2048)
    t.add_argument("--tensor-parallel-size", type=V.integer(1), default=1,
                   help="ranks pagedserve's engine is split across")
    t.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON here")
    t.add_argument("--speculative-config", default=None, type=S.speculative_json,
                   help="run pagedserve with speculative decoding (vLLM's JSON); the acceptance rate and mean "
                        "acceptance length are reported")
    t.add_argument("--lora-adapters", default=None,
                   help="comma-separated counts of rank-8 LoRA adapters in the mix, e.g. 0,1,4: throughput of each "
                        "and its ratio to the base model (0) in the same run, instead of the baselines")
    t.add_argument("--lora-passes", type=V.integer(1), default=2,
                   help="with --lora-adapters: passes over the counts, alternately in order and reversed")
    t.add_argument("--quantization", default=None, choices=("gguf",),
                   help="gguf: serve the GGUF file's weights as stored (vLLM gets the same file; transformers, "
                        "which dequantizes it, is left out)")
    t.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"))
    t.set_defaults(handler="services.bench.offline.throughput:run",
                   flag_check="services.bench.offline.throughput:check_flags")
    mc = bsub.add_parser("moe-checkpoints", help="write the random Qwen3-MoE checkpoint (64 experts, top 8) and the "
                         "dense one of equal active parameters that the MoE throughput figures run")
    mc.add_argument("--out", default=None, help="directory to write them in (default: pagedserve's cache)")
    mc.set_defaults(handler="services.bench.offline.moe_checkpoints:run")
    gd = bsub.add_parser("guard", help="the default path's cost per step (scheduler with the null executor, engine "
                         "on a tiny model, W1 and W3 shapes) against references in the same run; exits 1 past a budget")
    gd.add_argument("--repeats", type=V.integer(1), default=5)
    gd.add_argument("--inject", default="none", choices=("none", "scheduler", "engine"),
                    help="add a per-step cost on purpose, to see the guard fail on it")
    gd.add_argument("--json", dest="json_path", default=None)
    gd.set_defaults(handler="services.bench.offline.default_path_guard:run")
    d = bsub.add_parser("spec-decode", help="speculative decoding against none on copy-heavy chats, side by side "
                        "in one run, at each batch size (tokens/s, acceptance rate, mean acceptance length)")
    d.add_argument("--speculative-config", default=None, type=S.speculative_json,
                   help="vLLM's JSON (default: ngram, 4 tokens, prompt lookup 2-4)")
    d.add_argument("--model", default=None)
    d.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    d.add_argument("--batch-sizes", default="1", help="comma-separated running-batch caps, e.g. 1,4,16,64")
    d.add_argument("--num-prompts", type=V.integer(1), default=24,
                   help="chats per pass, 8 of each kind by default (at least twice the batch size)")
    d.add_argument("--max-tokens", type=V.integer(1), default=128)
    d.add_argument("--passes", type=V.integer(1), default=3, help="alternating passes of each engine per batch size")
    d.add_argument("--num-kv-blocks", type=V.integer(1), default=2048)
    d.add_argument("--identity", type=V.integer(0), default=0,
                   help="also compare N greedy outputs and report the target's top-2 gap where they part")
    d.add_argument("--seed", type=V.integer(), default=0)
    d.add_argument("--json", dest="json_path", default=None)
    d.set_defaults(handler="services.bench.offline.spec_decode:run")
    qb = bsub.add_parser("quant", help="the bundled model in each weight format side by side: weight bytes and "
                         "decode tokens/s at batch 1 and 64; with --kv-fp8, the FP8 KV cache's blocks and agreement")
    qb.add_argument("--formats", default="bf16,gguf-q4_1,gguf-q8_0", help="comma-separated: bf16, gguf-q4_1, "
                    "gguf-q8_0")
    qb.add_argument("--batches", type=V.positive_ints, default=[1, 64])
    qb.add_argument("--decode-tokens", type=V.integer(1), default=32, help="new tokens per sequence")
    qb.add_argument("--passes", type=V.integer(1), default=3, help="passes over the formats, alternately in order "
                    "and reversed (medians and ranges reported)")
    qb.add_argument("--num-kv-blocks", type=V.integer(2), default=512)
    qb.add_argument("--kv-fp8", action="store_true", help="also the FP8 KV cache against a bf16 one")
    qb.add_argument("--kv-cache-memory", type=V.byte_size, default="64M",
                    help="with --kv-fp8: the fixed KV memory compared")
    qb.add_argument("--kv-prompts", type=V.integer(1), default=100)
    qb.add_argument("--kv-max-tokens", type=V.integer(1), default=32)
    qb.add_argument("--json", dest="json_path", default=None)
    qb.set_defaults(handler="services.bench.offline.quant_formats:run")
    gk = bsub.add_parser("gemm", help="the CPU linears' kernels alone at the model's shapes (pagedserve's "
                         "bf16_gemm and PyTorch's oneDNN linear, GFLOP/s) and the memory's copy rate")
    gk.add_argument("--model", default=None, help="whose linear shapes (default: the bundled model)")
    gk.add_argument("--rows", type=V.positive_ints, default=[1, 16, 64, 256], help="row counts m, comma-separated")
    gk.add_argument("--seed", type=V.integer(), default=0)
    gk.add_argument("--json", dest="json_path", default=None)
    gk.set_defaults(handler="services.bench.offline.gemm_kernels:run")
    pa = bsub.add_parser("prefill-attention", help="a fresh prompt's causal attention at the model's head shape: "
                         "PyTorch's CPU flash attention against pagedserve's AMX and AVX512-BF16 kernels, per length")
    pa.add_argument("--model", default=None, help="whose head shape (default: the bundled model)")
    pa.add_argument("--lengths", type=V.positive_ints, default=[32, 64, 128, 256, 512, 1024, 1536, 2048],
                    help="prompt lengths, comma-separated")
    pa.add_argument("--seed", type=V.integer(), default=0)
    pa.add_argument("--json", dest="json_path", default=None)
    pa.set_defaults(handler="services.bench.offline.prefill_kernels:run")
    ba = bsub.add_parser("before-after", help="bench throughput of this checkout against an earlier revision's, "
                         "alternating runs in one command, ratio of medians")
    ba.add_argument("--before", required=True, help="the earlier git revision (checked out in a temporary worktree)")
    ba.add_argument("--runs", type=V.integer(1), default=3, help="alternating runs of each")
    ba.add_argument("--json", dest="json_path", default=None)
    ba.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `bench throughput` arguments")
    ba.set_defaults(handler="services.bench.offline.before_after:run",
                    flag_check="services.bench.offline.before_after:check_flags")
    r = bsub.add_parser("routing", help="prefix routing vs round-robin on local clusters, shared-prefix chat")
    r.add_argument("--replicas", type=V.integer(1), default=3)
    r.add_argument("--groups", type=V.integer(1), default=8, help="distinct system prompts")
    r.add_argument("--questions", type=V.integer(1), default=12, help="user questions per system prompt")
    r.add_argument("--system-tokens", type=V.integer(1), default=400, help="approximate system prompt length")
    r.add_argument("--concurrency", type=V.integer(1), default=4, help="concurrent clients")
    r.add_argument("--max-tokens", type=V.integer(1), default=8)
    r.add_argument("--model", default=None)
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    r.add_argument("--block-size", type=V.integer(1, 1024), default=16)
    r.add_argument("--kv-cache-memory", type=V.byte_size, default="256M", help="per replica")
    r.add_argument("--max-num-seqs", type=V.integer(1), default=16)
    r.add_argument("--port", type=V.PORT, default=8000, help="router port of the clusters")
    r.add_argument("--seed", type=V.integer(), default=0)
    r.set_defaults(handler="services.bench.fleet.routing:run_routing", flag_check=f"{__name__}:block_size")
    s = bsub.add_parser("serve", help="online serving through HTTP: rate sweeps, TTFT/TPOT/ITL, goodput; "
                        "against any endpoint, pagedserve's servers and vLLM's")
    s.add_argument("--endpoint", type=V.HTTP_URL, default=None, help="an OpenAI-compatible server to measure, e.g. http://host:8000")
    s.add_argument("--systems", default=None, help="pagedserve servers to start and measure: serve, up")
    s.add_argument("--against", default=None, choices=("vllm",), help="also start and measure vLLM's server")
    s.add_argument("--model", default=None)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    s.add_argument("--kv-cache-memory", type=V.byte_size, default="2G", help="KV cache of every started server")
    s.add_argument("--max-model-len", type=V.integer(1), default=2048)
    s.add_argument("--workload", default="random", choices=("random", "chat", "shared-prefix", "multi-turn"))
    s.add_argument("--num-requests", type=V.integer(1), default=64, help="requests per rate (sessions for multi-turn)")
    s.add_argument("--input-len", default="32-512", help="prompt tokens: N or LOW-HIGH")
    s.add_argument("--output-len", default="16-256", help="output tokens: N or LOW-HIGH")
    s.add_argument("--prefix-len", type=V.integer(0), default=384, help="shared-prefix: tokens each group shares")
    s.add_argument("--groups", type=V.integer(1), default=8, help="shared-prefix groups")
    s.add_argument("--turns", type=V.integer(1), default=4, help="multi-turn: turns per session")
    s.add_argument("--rates", default="1,2,4", help="request rates to sweep (req/s; 'inf' sends all at once)")
    s.add_argument("--arrival", default="poisson", choices=("poisson", "gamma", "concurrency"))
    s.add_argument("--burstiness", type=V.number(0, above=True), default=1.0,
                   help="gamma shape: < 1 burstier than Poisson")
    s.add_argument("--concurrency", type=V.integer(1), default=None, help="cap on requests in flight")
    s.add_argument("--slo", default="ttft=500ms,tpot=100ms", help="goodput counts requests meeting it")
    s.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore it)")
    s.add_argument("--structured", type=V.number(0, high=1), default=0.0,
                   help="share of requests (0-1) constrained to a JSON schema (response_format json_schema)")
    s.add_argument("--structured-compare", type=V.integer(0), default=0, metavar="N",
                   help="N pairs of passes at each rate, every request unconstrained in one and held to a JSON schema "
                        "in the other (alternating order): the TPOT ratio is constrained decoding's cost end to end")
    s.add_argument("--warmup", type=V.integer(0), default=8, help="requests sent to each server before measuring")
    s.add_argument("--lora-adapters", default=None,
                   help="comma-separated counts of rank-8 LoRA adapters in the mix, e.g. 0,1,4: starts one `pagedserve "
                        "serve` with them and gives each count's throughput and its ratio to the base model (0)")
    s.add_argument("--seed", type=V.integer(), default=0)
    s.add_argument("--speculative-config", default=None, type=S.speculative_json,
                   help="vLLM's JSON: every started pagedserve system runs again with it, on the same workload "
                        "(acceptance rate and mean acceptance length reported)")
    s.add_argument("--log-dir", default=None, help="where started servers' logs go (default .bench/logs)")
    s.add_argument("--json", dest="json_path", default=None)
    s.add_argument("--plot", default=None, help="write latency-vs-rate and CDF plots to this PNG (matplotlib)")
    s.set_defaults(handler="services.bench.serve.run:run", flag_check="services.bench.serve.run:check_flags")
    g = bsub.add_parser("structured", help="mixed structured-output requests with the openai client against an "
                        "endpoint, every answer parsed and validated")
    g.add_argument("--endpoint", type=V.HTTP_URL, required=True, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument("--num-requests", type=V.integer(1), default=200)
    g.add_argument("--concurrency", type=V.integer(1), default=16)
    g.add_argument("--max-tokens", type=V.integer(1), default=256)
    g.set_defaults(handler="services.bench.serve.structured_check:run")
    c = bsub.add_parser("chaos", help="faults under load on a local cluster: engine kill, Redis outage, dropped "
                        "streams, scheduler drain, overload burst")
    c.add_argument("--model", default=None)
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    c.add_argument("--replicas", type=V.integer(1), default=2)
    c.add_argument("--streams", type=V.integer(1), default=16, help="streams in flight when the engine is killed")
    c.add_argument("--redis-outage", type=V.number(0), default=20.0, help="seconds Redis stays stopped")
    c.add_argument("--dropped", type=V.integer(0), default=200, help="clients that drop their stream after one token")
    c.add_argument("--burst", type=V.integer(1), default=600, help="requests sent at once")
    c.add_argument("--scenarios", default=None, help="comma-separated subset of: engine-kill, redis-outage, "
                   "dropped-streams, drain, overload")
    c.add_argument("--json", dest="json_path", default=None)
    c.set_defaults(handler="services.bench.fleet.chaos:run", flag_check="services.bench.fleet.chaos:check_flags")
    _add_bench_paper(bsub)
    x = bsub.add_parser("index", help="the prefix index under a simulated fleet: cost per decision against N")
    x.add_argument("--replicas", default="10,100,1000", help="comma-separated fleet sizes")
    x.add_argument("--redis-cluster", type=V.integer(0), default=0, help="run on a local cluster of this many shards")
    x.add_argument("--cached-blocks", type=V.integer(0), default=1000, help="background blocks each replica caches")
    x.add_argument("--capacity", type=V.integer(1), default=4000, help="blocks a replica's cache holds")
    x.add_argument("--groups-per-replica", type=V.integer(1), default=1, help="system prompts per replica")
    x.add_argument("--questions", type=V.integer(1), default=10, help="requests per system prompt")
    x.add_argument("--min-decisions", type=V.integer(1), default=10_000,
                   help="decisions per fleet size at least (small fleets run more rounds of fresh groups): the "
                        "default, one round at 1,000 replicas, gives every size the same number of prompts, so "
                        "the index holds as many keys of them whatever the fleet size")
    x.add_argument("--hold", type=V.integer(0), default=0, help="decisions a request stays in flight (0: 2 x replicas)")
    x.add_argument("--publish-every", type=V.integer(1), default=10, help="decisions between two event publishes")
    x.add_argument("--event-seconds", type=V.number(0, above=True), default=3.0, help="length of the event-rate phase")
    x.add_argument("--event-scale", type=V.number(0, above=True), default=1.0,
                   help="fraction of the H200 event rate (2,000 block events/s per replica) to generate")
    x.add_argument("--passes", type=int, default=1, choices=range(1, 21), metavar="1..20",
                   help="runs of every size, in alternating order; each figure is their median")
    x.add_argument("--replay-seconds", type=V.number(0), default=1.0,
                   help="seconds of the fleet's index writes at the H200 rate, recorded then sent at once (0: skip)")
    x.add_argument("--write-rate", type=V.number(0), default=100.0,
                   help="block events per second per replica that writer processes file into the index while the "
                        "router decides (0: decide on an idle index); the rate achieved is reported")
    x.add_argument("--writers", type=V.integer(1), default=1, help="writer processes sharing the fleet's writes")
    x.add_argument("--special-decisions", type=V.integer(0), default=500,
                   help="session and LoRA decisions each (the paths that rank the whole fleet), after the others")
    x.add_argument("--stride-decisions", type=V.integer(0), default=0,
                   help="decisions of the stride-cost workload (multi-turn sessions over shared documents quoted to "
                        "different depths) per grid: the stride's index against one that files every block (0: skip)")
    x.add_argument("--stride-replicas", default="10,100", help="fleet sizes of the stride-cost workload")
    x.add_argument("--stride-grids", default=f"{DENSE}:{STRIDE}",
                   help="grids (dense:stride, comma-separated) the stride-cost workload compares with the exact index")
    x.add_argument("--seed", type=V.integer(), default=0)
    x.add_argument("--json", dest="json_path", default=None)
    x.add_argument("--plot", default=None, help="PNG of cost per decision against fleet size")
    x.set_defaults(handler="services.bench.index.run:run", flag_check="services.bench.index.run:check_flags")
    o = bsub.add_parser("router-overhead", help="median time the router adds between client and scheduler, and "
                                                "the router's and scheduler's CPU per request on a real cluster")
    o.add_argument("--requests", type=V.integer(1), default=500)
    o.add_argument("--no-cpu", dest="cpu", action="store_false",
                   help="skip the CPU-per-request part (it starts `pagedserve up` on the bundled model)")
    o.add_argument("--model", default=None, help="model of the CPU-per-request part (default: the bundled one)")
    o.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    o.set_defaults(handler="services.bench.fleet.router_overhead:run_overhead")


def _add_bench_paper(bsub) -> None:
    q = bsub.add_parser("paper", help="the Orca and vLLM papers' baselines (request-level, Orca-Max/Pow2/Oracle) "
                        "against pagedserve on one engine: KV memory breakdown, latency vs rate, sharing savings")
    q.add_argument("--model", default=None,
                   help="the engine's model (default: a 2-layer random Llama built once into the cache, in float32: "
                        "the comparison is of scheduling and KV placement, and SmolLM2's CPU steps would take hours)")
    q.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default: float32 for the default model, else bfloat16")
    q.add_argument("--workloads", default="sharegpt,alpaca", help="comma-separated: sharegpt, alpaca")
    q.add_argument("--systems", default="pagedserve,orca-oracle,orca-pow2,orca-max,request-level",
                   help="comma-separated serving systems (pagedserve first: the bound and trace length derive from it)")
    q.add_argument("--scale-sharegpt", type=V.number(0, above=True), default=0.125,
                   help="ShareGPT lengths, maximum sequence length and pool times this")
    q.add_argument("--scale-alpaca", type=V.number(0, above=True), default=0.5, help="the same for Alpaca")
    q.add_argument("--trace-requests", type=V.integer(1), default=200,
                   help="every trace lasts as long as pagedserve takes to serve this many requests all at once (so "
                        "a rate r gets r x that many seconds of requests)")
    q.add_argument("--min-requests", type=V.integer(1), default=50,
                   help="fewest requests of a trace (a low rate runs longer)")
    q.add_argument("--bracket", type=V.number(1, above=True), default=1.10,
                   help="bisect each system's sustained rate until failed / passed is at most this")
    q.add_argument("--bound-factor", type=V.number(0, above=True), default=2.0,
                   help="latency bound: this times pagedserve's normalized latency at 1/8 of its capacity")
    q.add_argument("--sharing-requests", type=V.integer(0), default=8, help="requests of the sharing runs (0: skip)")
    q.add_argument("--sharing-pool-blocks", type=V.integer(1), default=640)
    q.add_argument("--block-size", type=V.integer(1, 1024), default=16)
    q.add_argument("--max-num-seqs", type=V.integer(1), default=256)
    q.add_argument("--max-num-batched-tokens", type=V.integer(1), default=2048)
    q.add_argument("--seed", type=V.integer(), default=0)
    q.add_argument("--step-cost", default="cpu", choices=("cpu", "a100-opt13b"),
                   help="what a step costs on the virtual clock: measured here (CPU time), or modeled for the paper's "
                        "OPT-13B on an A100 (an uncalibrated roofline; the real engine still runs every step)")
    q.add_argument("--threads", type=V.integer(0), default=1,
                   help="torch threads; at 1 each step is timed on CPU time, which other processes' load does not "
                        "inflate (0: torch's default, timed on wall time)")
    q.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON here")
    q.add_argument("--plot", default=None, help="write the figures to this PNG (matplotlib)")
    q.set_defaults(handler="services.bench.paper.run:run", flag_check="services.bench.paper.run:check_flags")


# -- helpers of the benches' own flag checks ------------------------------------------------------------
# Each bench checks its lists and specs with its own parsers in a `check_flags(args)` that its subparser
# names by string, as it names its handler (commands never import a bench: the benches import commands).

def items(ns: argparse.Namespace, dest: str) -> list[str]:
    return [item.strip() for item in str(getattr(ns, dest) or "").split(",") if item.strip()]


def one_of(ns: argparse.Namespace, dest: str, allowed) -> list[str]:
    """The flag's comma-separated items, each one of `allowed`."""
    chosen = items(ns, dest)
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        raise FlagError(f"{flag(dest)} {getattr(ns, dest)}: comma-separated, each one of {', '.join(allowed)}")
    return chosen


def parsed(ns: argparse.Namespace, dest: str, parse):
    """The flag's text through `parse`, the bench's own parser of it (one definition of what it accepts)."""
    try:
        return parse(getattr(ns, dest))
    except (ValueError, KeyError, IndexError) as exc:
        raise FlagError(f"{flag(dest)} {getattr(ns, dest)}: {exc}") from None


def lora_counts(text: str) -> list[int]:
    """--lora-adapters: adapter counts of the mix, e.g. 0,1,4 (0: the base model alone)."""
    try:
        counts = sorted({int(c) for c in text.split(",")})
    except ValueError:
        raise ValueError("expected counts like 0,1,4") from None
    if counts[0] < 0:
        raise ValueError("counts must be >= 0")
    return counts


def positive_numbers(text: str, kind=float) -> list:
    values = [kind(x) for x in text.split(",") if x.strip()]
    if not values or any(not v > 0 for v in values):
        raise ValueError("expected comma-separated numbers > 0")
    return values


def block_size(ns: argparse.Namespace) -> None:
    from services.engine.config import EngineConfig, EngineConfigError

    try:
        EngineConfig(block_size=ns.block_size)
    except EngineConfigError as exc:
        raise FlagError(f"--block-size {ns.block_size}: {exc.message}") from None
