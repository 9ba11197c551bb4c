"""One rate's load against an OpenAI-compatible server: requests sent on their arrival schedule (or a
concurrency cap), each streamed and timed."""

from __future__ import annotations

import asyncio
import time

import httpx
from tqdm import tqdm

from services.bench.serve.client import RequestResult, completion_body, run_session, stream_one
from services.bench.serve.workloads import ServeRequest, arrival_gaps


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
