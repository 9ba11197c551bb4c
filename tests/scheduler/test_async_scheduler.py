"""The asyncio front of the engine core: streaming, early exit aborts, engine failures end requests."""

from __future__ import annotations

import asyncio

import pytest

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.async_scheduler import AsyncScheduler
from services.scheduler.core import SchedulerCore
from tests.scheduler.conftest import shared_tokenizer
from tests.scheduler.shadow_executor import ShadowExecutor


@pytest.fixture
def engine():
    ex = ShadowExecutor(num_blocks=64, block_size=4)
    core = SchedulerCore(ex, shared_tokenizer(), max_num_seqs=8, max_num_batched_tokens=32, collect_kv_events=True)
    ex.lookup = lambda sid: next(r.token_ids for r in core.scheduler.running if r.seq_id == sid)
    eng = AsyncScheduler(core, idle_wait=0.05)
    yield eng
    eng.shutdown()


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_streams_cumulative_outputs_concurrently(engine):
    async def one(rid, n):
        seen = []
        async for out in engine.generate(rid, [10 + len(rid)] * 6, greedy(n)):
            seen.append(len(out.outputs[0].token_ids))
        return seen, out

    async def main():
        return await asyncio.gather(one("a", 5), one("bb", 9), one("ccc", 3))

    results = asyncio.run(main())
    for (seen, final), n in zip(results, (5, 9, 3), strict=True):
        assert seen == sorted(seen) and seen[-1] == n
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].text  # detokenized incrementally


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        async for out in engine.generate("gone", [20] * 6, greedy(1000)):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.core.has_unfinished():
                break

    asyncio.run(main())
    assert engine.core.pool.num_in_use == 0
    assert engine.core.stats().num_running == 0


def test_invalid_request_raises_before_queueing(engine):
    async def main():
        with pytest.raises(InvalidRequestError) as e:
            async for _ in engine.generate("bad", [], greedy(3)):
                pass
        assert e.value.field == "prompt"
        return [o async for o in engine.generate("good", [30] * 5, greedy(2))][-1]

    assert asyncio.run(main()).finished


def test_engine_failure_ends_in_flight_requests_and_loop_survives(engine):
    ex = engine.core.executor
    real = ex.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ConnectionError("engine went away")
        return real(out)

    ex.execute = flaky

    async def main():
        first = [o async for o in engine.generate("victim", [40] * 5, greedy(50))][-1]
        after = [o async for o in engine.generate("after", [41] * 5, greedy(4))][-1]
        return first, after

    first, after = asyncio.run(main())
    assert first.finished and first.outputs[0].finish_reason == "error" and "engine went away" in first.error
    assert after.outputs[0].finish_reason == "length" and len(after.outputs[0].token_ids) == 4
    assert engine.core.pool.num_in_use == 0


def test_call_runs_on_the_loop_thread(engine):
    import threading

    seen = engine.call(lambda: threading.current_thread().name)
    assert seen == "engine-loop"
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda: 1 / 0)
    assert engine.call(engine.core.fail_all, "reset") == []


def test_kv_events_drain_across_threads(engine):
    async def main():
        for i in range(5):
            async for _ in engine.generate(f"e{i}", [50 + i] * 12, greedy(6)):
                pass

    asyncio.run(main())
    stored = [h for e in engine.core.drain_kv_events() if e.kind == "stored" for h in e.block_hashes]
    assert len(stored) == len(set(stored)) >= 5 * 3
    assert engine.core.drain_kv_events() == []
