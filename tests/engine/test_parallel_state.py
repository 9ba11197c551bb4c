"""The bounded wait behind `RankGroup.wait_device` (NCCL work never blocks the host; a dead peer must
become a group error, not a hang). The wait on a real CUDA event runs only on GPUs; the deadline logic
runs here, and the gloo group's own failures are tested in test_tensor_parallel.py."""

from __future__ import annotations

import time

from services.engine.parallel_state import wait_until


def test_wait_until_returns_once_done():
    polls = []

    def done() -> bool:
        polls.append(1)
        return len(polls) >= 4

    started = time.monotonic()
    assert wait_until(done, timeout_s=5.0)
    assert len(polls) == 4 and time.monotonic() - started < 1.0


def test_wait_until_gives_up_at_its_deadline():
    started = time.monotonic()
    assert not wait_until(lambda: False, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - started < 1.0
