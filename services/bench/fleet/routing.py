"""Routing benchmarks on real local clusters (`pagedserve up`'s processes).

`bench routing`: a shared-prefix chat workload (G system prompts of ~S tokens, Q questions each,
shuffled, C concurrent clients) through the prefix router and through round-robin, each on a fresh
cluster; prints the prompt tokens served from cache against what a perfect router would get, and each
replica's share of requests against its fair share.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import httpx

from services.bench.offline.workloads import shared_prefix_chats


@dataclass
class Result:
    policy: str
    cached: int
    prompt: int
    per_replica: Counter
    seconds: float
    errors: int


def perfect_cached(prompts: list[list[int]], block_size: int) -> int:
    """Tokens a perfect router serves from cache: each prompt reuses its longest block-aligned common
    prefix with any earlier prompt (it would be sent where that prefix lives)."""
    total = 0
    seen: list[list[int]] = []
    for p in prompts:
        best = 0
        for q in seen:
            n = 0
            for a, b in zip(p, q, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        # The engine always computes the last prompt token itself, so a full-prompt hit leaves one out.
        total += (min(best, len(p) - 1) // block_size) * block_size
        seen.append(p)
    return total


def _drive(router_url: str, model: str, workload, concurrency: int, max_tokens: int) -> Result:
    import openai

    client = openai.OpenAI(base_url=router_url + "/v1", api_key="bench", max_retries=0, timeout=600)
    per_replica: Counter = Counter()
    cached = prompt = errors = 0

    def one(messages):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages,
                                                               max_tokens=max_tokens, temperature=0.0)
        return raw.headers.get("x-pagedserve-replica"), raw.parse().usage

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for fut in [pool.submit(one, msgs) for _, msgs in workload]:
            try:
                replica, usage = fut.result()
            except Exception as exc:
                print(f"  request failed: {exc}")
                errors += 1
                continue
            per_replica[replica] += 1
            prompt += usage.prompt_tokens
            cached += usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Result("", cached, prompt, per_replica, time.monotonic() - t0, errors)


def run_routing(args) -> int:
    from services.commands.up import LocalCluster
    from services.model_files.model_source import resolve_model
    from services.model_files.tokenizer import ModelTokenizer

    workload = shared_prefix_chats(args.groups, args.questions, args.system_tokens, args.seed)
    tokenizer = ModelTokenizer(resolve_model(args.model))
    prompts = [tokenizer.apply_chat_template(msgs) for _, msgs in workload]
    perfect = perfect_cached(prompts, args.block_size)
    print(f"workload: {args.groups} system prompts x {args.questions} questions = {len(workload)} requests, "
          f"{sum(map(len, prompts))} prompt tokens, mean {statistics.mean(map(len, prompts)):.0f}; "
          f"{args.concurrency} concurrent clients; perfect router: {perfect} cached tokens")
    results = []
    for policy in ("prefix", "round-robin"):
        cluster_args = SimpleNamespace(
            host="127.0.0.1", port=args.port, model=args.model, served_model_name=None, dtype=args.dtype,
            device="cpu", block_size=args.block_size, num_kv_blocks=None, kv_cache_memory=args.kv_cache_memory,
            max_model_len=None, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=None,
            enable_prefix_caching=None, max_body_bytes=None, log_level="warning", policy=policy,
            api_keys_file=None, api_keys=None, redis_url=None)
        cluster = LocalCluster(cluster_args, args.replicas, routers=1)
        print(f"[{policy}] starting {args.replicas} replicas ...", flush=True)
        try:
            cluster.start()
            model = httpx.get(cluster.router_urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
            result = _drive(cluster.router_urls[0], model, workload, args.concurrency, args.max_tokens)
        finally:
            cluster.stop()
        result.policy = policy
        results.append(result)
        print(f"[{policy}] done in {result.seconds:.1f}s", flush=True)
    _report(results, perfect, len(workload), args.replicas)
    return 0


def _report(results: list[Result], perfect: int, n: int, replicas: int) -> None:
    fair = n / replicas
    print()
    print(f"{'policy':<12} {'cached tokens':>14} {'of perfect':>10} {'of prompt':>10} {'max/fair share':>14} "
          f"{'wall s':>7} {'errors':>6}  requests per replica")
    for r in results:
        share = max(r.per_replica.values()) / fair if r.per_replica else 0.0
        print(f"{r.policy:<12} {r.cached:>14} {r.cached / perfect:>10.1%} {r.cached / max(1, r.prompt):>10.1%} "
              f"{share:>14.2f} {r.seconds:>7.1f} {r.errors:>6}  {dict(sorted(r.per_replica.items()))}")
    prefix = results[0]
    ok = prefix.cached >= 0.9 * perfect and max(prefix.per_replica.values()) <= 1.5 * fair and not prefix.errors
    print(f"\nprefix routing: {prefix.cached / perfect:.1%} of perfect (target >= 90%), max share "
          f"{max(prefix.per_replica.values()) / fair:.2f}x fair (target <= 1.5x): {'PASS' if ok else 'FAIL'}")


# -- router overhead ------------------------------------------------------------------------------
