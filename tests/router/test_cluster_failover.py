"""The router on a real local Redis Cluster: a shard's primary killed under load loses no request (routing
degrades to load only while its slots fail over, then prefix routing resumes) and the index heals."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from services.commands.redis_cluster import LocalRedisCluster
from tests.router.fake_replicas import FakeReplicas
from tests.router.test_service import chat, chat_hashes, make_router


@pytest.fixture
def private_cluster():
    cluster = LocalRedisCluster(3).start()
    yield cluster
    cluster.stop()


def test_shard_failover_under_load_loses_no_request(tokenizer, private_cluster):
    with FakeReplicas(private_cluster.url, ["a", "b", "c"]) as fakes, make_router(tokenizer, private_cluster.url) as r:
        _, hashes = chat_hashes(tokenizer, "Where is parcel 1?")
        fakes.store_blocks("b", hashes[:-1])
        assert chat(r.url, "Where is parcel 1?").headers["x-pagedserve-replica"] == "b"

        stop = threading.Event()
        statuses: list[int] = []

        def client(k: int) -> None:
            i = 0
            while not stop.is_set():
                statuses.append(chat(r.url, f"question {k}-{i}").status_code)
                i += 1

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(client, k) for k in range(4)]
            deadline = time.monotonic() + 20
            while len(statuses) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            before = len(statuses)
            private_cluster.kill_primary(0)  # a third of the block keys (and maybe the records) lived there
            private_cluster.wait_ok(30)
            after = len(statuses)
            while len(statuses) < after + 4 and time.monotonic() < deadline + 20:
                time.sleep(0.05)
            stop.set()
            for w in workers:
                w.result()
        assert before > 0 and len(statuses) > before
        assert set(statuses) == {200}, statuses

        # The index heals: blocks written again (as a publisher's resync does) route by prefix again.
        fakes.store_blocks("b", hashes[:-1])
        for _ in range(50):
            if chat(r.url, "Where is parcel 1?").headers["x-pagedserve-replica"] == "b":
                break
            time.sleep(0.2)
        else:
            raise AssertionError("prefix routing did not resume after the failover")
