"""`pagedserve bench serve` against `pagedserve serve` with a tiny model: every workload, a rate sweep,
the JSON report and the plot; and the arithmetic under it (lengths, arrivals, percentiles, goodput)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest

from services.bench.serve.client import RequestResult
from services.bench.serve.metrics import SLO, percentile, summarize
from services.bench.serve.workloads import Lengths, WorkloadSpec, arrival_gaps, make_serve_workload


def test_lengths_arrivals_and_workloads_are_seeded_and_shaped():
    assert Lengths.parse("128") == Lengths(128, 128) and Lengths.parse("32-512") == Lengths(32, 512)
    with pytest.raises(ValueError):
        Lengths.parse("9-3")
    for arrival, kw in (("poisson", {}), ("gamma", {"burstiness": 0.25}), ("gamma", {"burstiness": 4.0})):
        gaps = arrival_gaps(4000, 8.0, arrival, kw.get("burstiness", 1.0), seed=1)
        assert abs(statistics.fmean(gaps) - 1 / 8) < 0.01  # the same mean rate whatever the burstiness
    bursty, regular = arrival_gaps(4000, 8.0, "gamma", 0.25, 1), arrival_gaps(4000, 8.0, "gamma", 4.0, 1)
    assert statistics.pstdev(bursty) > 3 * statistics.pstdev(regular)
    assert arrival_gaps(5, math.inf, "poisson", 1.0, 0) == [0.0] * 5
    spec = WorkloadSpec("shared-prefix", 24, Lengths(10, 20), Lengths(4, 4), prefix_len=48, groups=3)
    reqs = make_serve_workload(spec, 49152)
    assert reqs == make_serve_workload(spec, 49152) and len({tuple(r.prompt[:48]) for r in reqs}) == 3
    chat = make_serve_workload(WorkloadSpec("chat", 400, Lengths(1, 4096), Lengths(1, 1024)), 49152)
    lens = sorted(len(r.prompt) for r in chat)
    assert lens[len(lens) // 2] < 400 < lens[-5]  # long-tailed: median short, a tail far longer
    turns = make_serve_workload(WorkloadSpec("multi-turn", 8, Lengths(5, 9), Lengths(6, 6), turns=4), 49152)
    assert len(turns) == 2 and all(len(r.user_turns) == 4 for r in turns)


def test_percentiles_tpot_and_goodput():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    fast = RequestResult(0, ok=True, status=200, output_tokens=11, ttft=0.1, e2e=0.6, itl=[0.05] * 10)
    slow = RequestResult(1, ok=True, status=200, output_tokens=11, ttft=0.9, e2e=1.9, itl=[0.1] * 10)
    failed = RequestResult(2, status=503, error="full")
    assert fast.tpot == pytest.approx(0.05)
    s = summarize([fast, slow, failed], 2.0, SLO.parse("ttft=500ms,tpot=100ms"))
    assert s["completed"] == 2 and s["errors"] == {"503": 1} and s["goodput"] == 0.5
    assert s["output_throughput"] == 11 and s["ttft_s"]["p50"] == pytest.approx(0.5)


def test_a_chunk_without_text_still_marks_the_first_token():
    """As vLLM's benchmark counts it: a server that streams a token before it has text (half a UTF-8
    character, a special token) has produced its first token then, not at the first visible text."""
    import asyncio

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from services.bench.serve.client import stream_one

    chunks = [{"choices": [{"index": 0, "text": ""}]}, {"choices": [{"index": 0, "text": "\u05e6"}]},
              {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}]

    async def completions(request):
        async def body():
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app)) as client:
            return await stream_one(client, "http://test", {"prompt": [1, 2, 3]}, "/v1/completions", 0.0, 0)

    res = asyncio.run(go())
    assert res.ok and res.text == "\u05e6!" and res.output_tokens == 4 and res.prompt_tokens == 3
    assert res.ttft is not None and len(res.itl) == 2  # the empty chunk opened it; two more chunks followed


@pytest.fixture(scope="module")
def serve_url(tiny_llama_dir):
    from tests.e2e.test_serve import start_serve

    proc, url = start_serve(tiny_llama_dir)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.mark.parametrize("workload,extra", [
    ("random", ["--input-len", "8-64", "--output-len", "4-12", "--structured", "0.5"]),
    ("shared-prefix", ["--prefix-len", "64", "--groups", "2", "--input-len", "8", "--output-len", "6"]),
    ("multi-turn", ["--turns", "3", "--input-len", "6-10", "--output-len", "5", "--arrival", "gamma",
                    "--burstiness", "0.5"]),
])
def test_bench_serve_against_an_endpoint(serve_url, tmp_path, workload, extra):
    out, plot = tmp_path / "report.json", tmp_path / "plot.png"
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "serve", "--endpoint", serve_url,
                           "--workload", workload, "--num-requests", "9", "--rates", "8,inf", "--warmup", "2",
                           "--json", str(out), "--plot", str(plot), *extra], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| endpoint | 8 |" in done.stdout and "| endpoint | inf |" in done.stdout
    report = json.loads(out.read_text())
    runs = report["systems"]["endpoint"]
    assert [r["rate"] for r in runs] == [8.0, math.inf]
    expected = 9 if workload != "multi-turn" else 9 // 3 * 3
    for r in runs:
        assert r["completed"] == r["requests"] == expected and r["failed"] == 0
        assert r["output_throughput"] > 0 and r["ttft_s"]["p50"] > 0 and r["tpot_s"]["p99"] is not None
    assert plot.stat().st_size > 10_000
    if workload == "random":  # every rate gets its own prompts, so no rate is served from the last one's cache
        assert runs[0]["total_prompt_tokens"] != runs[1]["total_prompt_tokens"]
        for r in runs:  # about half the requests constrained: their masks were computed and timed
            assert r["structured"]["mask_ms_per_step"] > 0 and 0 < r["structured"]["constrained_share_of_rows"] < 1


def test_bench_serve_starts_and_stops_the_servers_it_measures(tiny_llama_dir, tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "serve", "--systems", "serve",
                           "--model", str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-memory", "64M",
                           "--max-model-len", "512", "--num-requests", "6", "--input-len", "8-32",
                           "--output-len", "4-8", "--rates", "inf", "--warmup", "1", "--log-dir", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(out.read_text())["systems"]["pagedserve serve"][0]
    assert run["completed"] == 6 and run["total_prompt_tokens"] >= 6 * 8
    assert (tmp_path / "pagedserve-serve.log").exists()


def test_structured_compare_alternates_constrained_and_unconstrained_passes(serve_url, tmp_path):
    """Constrained decoding's cost end to end: pairs of passes, every request constrained in one and none in
    the other, order alternating; the TPOT ratio with each pair's."""
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "serve", "--endpoint", serve_url,
                           "--num-requests", "4", "--input-len", "8-16", "--output-len", "6", "--rates", "inf",
                           "--warmup", "1", "--structured-compare", "2", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cost = json.loads(out.read_text())["structured_cost"]["endpoint"][0]
    assert [p["constrained"] for p in cost["passes"]] == [False, True, True, False]
    assert all(p["completed"] == p["requests"] == 4 for p in cost["passes"])
    masked = [p["mask"] for p in cost["passes"] if p["constrained"]]
    assert all(m["mask_ms_per_step"] > 0 and m["constrained_share_of_rows"] == 1.0 for m in masked)
    assert all(p["mask"] is None for p in cost["passes"] if not p["constrained"])  # no mask computed at all
    assert len(cost["ratio_per_pair"]) == 2 and cost["ratio_of_medians"] > 0
    assert "constrained / unconstrained TPOT p50" in done.stdout
