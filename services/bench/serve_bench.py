"""`pagedserve bench serve`: online serving through HTTP, like `vllm bench serve`, in one command.

Targets: `--endpoint URL` (any OpenAI-compatible server), or servers this command starts and stops
itself, one after the other on the same workload: `--systems serve,up` (pagedserve's two ways to run)
and `--against vllm` (vLLM's OpenAI server from `make vllm-env`). Started servers get the same model
files, dtype, KV cache memory, max model length and thread binding (every core), and the same warm-up.
Prints one table row per system and rate; `--json` keeps everything, `--plot` draws latency against
rate and TTFT/TPOT distributions. Timings are noisy here: compare systems within one run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx
from tqdm import tqdm

from services import metric_names as M
from services.bench.serve_client import RequestResult, completion_body, run_session, stream_one
from services.bench.serve_metrics import SLO, summarize
from services.bench.serve_workloads import (
    Lengths,
    ServeRequest,
    WorkloadSpec,
    arrival_gaps,
    make_serve_workload,
    mark_structured,
)

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
START_TIMEOUT = 900.0


class StartedServer:
    """A server process this command owns: started, waited for, stopped (its log kept for failures)."""

    def __init__(self, name: str, argv: list[str], env: dict, url: str, log_path: Path):
        self.name, self.url, self.log_path = name, url, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                models = httpx.get(self.url + "/v1/models", timeout=2).json().get("data") or []
                if models:
                    return models[0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


def _pagedserve(mode: str, args, port: int, log_dir: Path, extra: list[str] | None = None) -> StartedServer:
    argv = [sys.executable, "-m", "services.cli", mode, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
            str(args.max_model_len), "--log-level", "warning", *(extra or [])]
    if args.model:
        argv += ["--model", args.model]
    if mode == "up":
        argv += ["--replicas", "1"]
    return StartedServer(f"pagedserve {mode}", argv, dict(os.environ), f"http://127.0.0.1:{port}",
                         log_dir / f"pagedserve-{mode}.log")


def _vllm(args, port: int, model_dir: Path, served_name: str, log_dir: Path) -> StartedServer:
    if not VLLM_PYTHON.exists():
        raise RuntimeError("vLLM's virtualenv is missing: run `make vllm-env` first")
    cores = os.cpu_count() or 1
    kv_gib = max(1, round(_bytes(args.kv_cache_memory) / 2**30))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
               VLLM_TARGET_DEVICE="cpu")
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    return StartedServer("vllm", argv, env, f"http://127.0.0.1:{port}", log_dir / "vllm.log")


def _bytes(text: str) -> int:
    from services.settings import parse_bytes

    return parse_bytes(text)


async def run_load(url: str, model: str | list[str], requests: list[ServeRequest], rate: float, arrival: str,
                   burstiness: float, concurrency: int | None, seed: int, ignore_eos: bool,
                   headers: dict | None = None, progress: bool = True) -> tuple[list[RequestResult], float]:
    gaps = arrival_gaps(len(requests), rate, arrival, burstiness, seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=sum(max(1, len(r.user_turns)) for r in requests), desc=f"rate {rate:g}", unit="req",
               disable=not progress, leave=False)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: ServeRequest) -> None:
            if limit is not None:
                await limit.acquire()
            # Several models (adapters): the requests take turns over them.
            name = model if isinstance(model, str) else model[req.index % len(model)]
            try:
                if req.user_turns:
                    got = await run_session(client, url, name, req, t0, ignore_eos, headers)
                else:
                    got = [await stream_one(client, url, completion_body(name, req, ignore_eos), "/v1/completions",
                                            t0, req.index, headers)]
                results.extend(got)
                bar.update(len(got))
            finally:
                if limit is not None:
                    limit.release()

        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


_GUIDED = (M.GUIDED_MASK_SECONDS, M.GUIDED_MASK_STEPS, M.GUIDED_CONSTRAINED_ROWS, M.SAMPLED_ROWS)


def guided_counters(url: str) -> dict[str, float] | None:
    """The structured-output counters a pagedserve server exports (None: another server, or no metrics)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for name in _GUIDED:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        if m is None:
            return None
        found[name] = float(m.group(1))
    return found


def mask_cost(before: dict | None, after: dict | None) -> dict | None:
    """Mask time per step and the constrained share of sampled rows over one rate's run."""
    if before is None or after is None or after[M.GUIDED_MASK_STEPS] == before[M.GUIDED_MASK_STEPS]:
        return None
    d = {k: after[k] - before[k] for k in _GUIDED}
    return {"mask_ms_per_step": round(1000 * d[M.GUIDED_MASK_SECONDS] / d[M.GUIDED_MASK_STEPS], 3),
            "steps_with_masks": int(d[M.GUIDED_MASK_STEPS]),
            "constrained_share_of_rows": round(d[M.GUIDED_CONSTRAINED_ROWS] / max(1.0, d[M.SAMPLED_ROWS]), 3)}


def parse_rates(text: str) -> list[float]:
    return [math.inf if r.strip() in ("inf", "max") else float(r) for r in text.split(",") if r.strip()]


def _row(system: str, rate: float, s: dict) -> str:
    def ms(d: dict, key: str) -> str:
        return f"{d[key] * 1000:.0f}" if d[key] is not None else "-"

    return (f"| {system} | {rate:g} | {s['completed']}/{s['requests']} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.1f} | {ms(s['ttft_s'], 'p50')} / {ms(s['ttft_s'], 'p99')} | "
            f"{ms(s['tpot_s'], 'p50')} / {ms(s['tpot_s'], 'p99')} | {ms(s['itl_s'], 'p50')} | "
            f"{ms(s['e2e_s'], 'p50')} | {s['goodput']:.2f} | {s['errors'] or '-'} |")


TABLE_HEAD = ("| system | rate (req/s) | completed | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
              "ITL p50 ms | E2E p50 ms | goodput req/s | errors |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _lora(args, rates, workloads, vocab: int, slo: SLO, log_dir: Path) -> int:
    from services.bench import serve_lora

    try:
        counts = sorted({int(c) for c in args.lora_adapters.split(",")})
    except ValueError:
        print(f"--lora-adapters: expected counts like 0,1,4, got {args.lora_adapters!r}", file=sys.stderr)
        return 2
    if counts[0] < 0 or args.endpoint or args.against or args.structured:
        print("--lora-adapters: counts >= 0, and it starts its own `pagedserve serve` (no --endpoint, --against "
              "or --structured)", file=sys.stderr)
        return 2
    try:
        report = serve_lora.run(args, counts, rates, workloads, vocab, slo, log_dir)
    except ValueError as exc:
        print(f"--lora-adapters: {exc}", file=sys.stderr)
        return 2
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str))
    return 0


def run(args) -> int:
    from services.model_source import resolve_model, resolve_tokenizer
    from services.ports import free_port
    from services.tokenizer import ModelTokenizer

    spec = WorkloadSpec(args.workload, args.num_requests, Lengths.parse(args.input_len),
                        Lengths.parse(args.output_len), args.prefix_len, args.groups, args.turns, args.seed)
    vocab = ModelTokenizer(resolve_tokenizer(args.model)).vocab_size
    rates = parse_rates(args.rates)
    # Each rate gets its own prompts (same for every system): with one set, every rate after the first
    # would hit the prefix cache the previous rate filled and report prefill-free TTFTs.
    workloads = [make_serve_workload(replace(spec, seed=spec.seed + 1000 * i), vocab) for i in range(len(rates))]
    if not 0.0 <= args.structured <= 1.0:
        print("--structured is a share of requests, in [0, 1]", file=sys.stderr)
        return 2
    for i, w in enumerate(workloads):
        mark_structured(w, args.structured, spec.seed + i)
    requests = workloads[0]
    slo = SLO.parse(args.slo)
    log_dir = Path(args.log_dir or ".bench/logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    if getattr(args, "lora_adapters", None):
        return _lora(args, rates, workloads, vocab, slo, log_dir)
    systems: list[tuple[str, object]] = []
    if args.endpoint:
        systems.append(("endpoint", args.endpoint.rstrip("/")))
    for mode in [m.strip() for m in (args.systems or "").split(",") if m.strip()]:
        systems.append((f"pagedserve {mode}", lambda port, mode=mode: _pagedserve(mode, args, port, log_dir)))
    if args.against == "vllm":
        model_dir = resolve_model(args.model)
        served = args.served_model_name or "SmolLM2-135M-Instruct"
        systems.append(("vllm", lambda port: _vllm(args, port, model_dir, served, log_dir)))
    if not systems:
        print("nothing to benchmark: give --endpoint URL, --systems serve[,up] and/or --against vllm",
              file=sys.stderr)
        return 2
    print(f"workload {spec.name}: {len(requests)} {'sessions' if spec.name == 'multi-turn' else 'requests'}, "
          f"rates {args.rates}, arrival {args.arrival}, SLO {slo}; machine {os.cpu_count()} cores", flush=True)
    report = {"workload": asdict(spec), "rates": args.rates, "arrival": args.arrival, "slo": str(slo),
              "systems": {}}
    for name, target in systems:
        server = None
        try:
            if callable(target):
                server = target(free_port())
                url = server.url
                model = server.wait_ready()
            else:
                url, model = target, httpx.get(target + "/v1/models", timeout=30).json()["data"][0]["id"]
            warm = make_serve_workload(WorkloadSpec("random", args.warmup, Lengths(16, 64), Lengths(8, 8),
                                                    seed=args.seed + 99), vocab)
            asyncio.run(run_load(url, model, warm, math.inf, "poisson", 1.0, None, 0, True, progress=False))
            report["systems"][name] = []
            for rate, requests in zip(rates, workloads, strict=True):
                before = guided_counters(url)
                results, duration = asyncio.run(run_load(url, model, requests, rate, args.arrival, args.burstiness,
                                                         args.concurrency, args.seed, not args.no_ignore_eos))
                summary = summarize(results, duration, slo)
                summary["rate"] = rate
                summary["structured"] = mask_cost(before, guided_counters(url))
                if summary["structured"]:
                    print(f"  structured: {summary['structured']}", flush=True)
                report["systems"][name].append(summary)
                print(_row(name, rate, summary), flush=True)
        finally:
            if server is not None:
                server.stop()
    print("\n" + TABLE_HEAD)
    for name, runs in report["systems"].items():
        for s in runs:
            print(_row(name, s["rate"], s))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        from services.bench.serve_plot import plot_report

        plot_report(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0
