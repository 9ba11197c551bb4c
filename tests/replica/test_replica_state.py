"""Engine health of a replica: a request's own failure leaves the replica healthy; an engine-wide failure
marks it unhealthy, and an in-process engine (`pagedserve serve`) that answers again brings it back
within seconds, as a remote one does in `up` (tests/e2e/test_cluster.py)."""

from __future__ import annotations

import asyncio
import time

from services.replica.service import ReplicaSettings, build_replica
from services.request.sampling_params import SamplingParams
from services.scheduler.executor import InProcessExecutor
from tests.scheduler.conftest import shared_tokenizer
from tests.scheduler.shadow_executor import ShadowExecutor


class FlakyRunner(ShadowExecutor):
    """Fails every step while `broken`; fails steps holding `poison` always."""

    broken = False
    poison = "none"

    def execute(self, out):
        if self.broken:
            raise RuntimeError("device lost")
        if any(s.seq_id.startswith(self.poison) for s in out.sequences):
            raise RuntimeError("bad row")
        return super().execute(out)


async def _generate(replica, rid: str):
    last = None
    async for out in replica.generate(rid, [11, 12, 13, 14, 15], SamplingParams(temperature=0, max_tokens=4)):
        last = out
    return last


def test_request_failures_keep_the_replica_healthy_and_engine_failures_heal():
    runner = FlakyRunner(num_blocks=64, block_size=4)
    service = build_replica(InProcessExecutor(runner), shared_tokenizer(), ReplicaSettings(served_model_name="s"))
    replica = service.replica

    async def main():
        supervisor = asyncio.create_task(replica.supervise())
        try:
            runner.poison = "bad"
            out = await _generate(replica, "bad-1")
            assert out.error_kind == "request" and replica.healthy
            runner.poison = "none"

            runner.broken = True
            out = await _generate(replica, "r-1")
            assert out.error_kind == "engine" and not replica.healthy
            runner.broken = False
            t0 = time.monotonic()
            while not replica.healthy:
                assert time.monotonic() - t0 < 5, "the replica did not come back"
                await asyncio.sleep(0.05)
            out = await _generate(replica, "r-2")
            assert out.error is None and len(out.outputs[0].token_ids) == 4
        finally:
            supervisor.cancel()

    try:
        asyncio.run(main())
    finally:
        replica.loop.shutdown()
