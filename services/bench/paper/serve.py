"""One system serving one Poisson trace on the real engine, timed step by step on a virtual clock.

Every step runs the real scheduler and the real model on this machine and advances the clock by what
it cost (services.bench.paper.step_cost: measured here, or modeled for the paper's GPU); requests join when
the clock passes their arrival. When nothing is in flight the
clock jumps to the next arrival instead of sleeping, so a rate sweep costs only the time the engine
computes, while queueing, batching and every step's cost are the measured ones.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass

from services.bench.paper.step_cost import MeasuredStep
from services.bench.paper.workloads import TraceRequest
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore


class PoolView:
    """An executor over a shared engine that reports a smaller KV pool and maximum length, so each run's
    scheduler uses only the first `num_blocks` blocks of the engine's cache."""

    def __init__(self, executor, num_blocks: int, max_model_len: int):
        if num_blocks > executor.handshake().num_kv_blocks:
            raise ValueError(f"the engine holds {executor.handshake().num_kv_blocks} KV blocks, not {num_blocks}")
        self._inner = executor
        self.info = dataclasses.replace(executor.handshake(), num_kv_blocks=num_blocks, max_model_len=max_model_len)
        self.url, self.instance = executor.url, executor.instance

    def handshake(self):
        return self.info

    def __getattr__(self, name):
        return getattr(self._inner, name)


@dataclass
class RunResult:
    rate: float  # offered, requests/s (inf: all at once)
    normalized_latency: float  # mean over requests of end-to-end seconds / output tokens
    mean_latency: float  # seconds
    throughput: float  # requests/s served: requests / time from the first arrival to the last finish
    output_tokens_per_s: float
    busy_seconds: float  # engine + scheduler time the run took, on the run's clock
    max_running: int
    preemptions: int

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in self.__dict__.items()}


def serve_trace(core: SchedulerCore, trace: list[TraceRequest], rate: float, on_step=None,
                step_cost=MeasuredStep(time.perf_counter, "measured: wall time")) -> RunResult:
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    info: dict[str, TraceRequest] = {}
    clock = busy = 0.0
    latencies: list[tuple[float, int]] = []
    max_running = 0
    while pending or core.has_unfinished():
        if not core.has_unfinished() and pending[0].arrival > clock:
            clock = pending[0].arrival
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            info[r.request_id] = r
            core.add_request(r.request_id, r.prompt_token_ids,
                             SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        outputs, dt = step_cost.run(core)
        clock += dt
        busy += dt
        max_running = max(max_running, len(core.scheduler.running))
        if on_step is not None:
            on_step(core)
        for out in outputs:
            if out.finished:
                n = len(out.outputs[0].token_ids)
                latencies.append((clock - info[out.request_id].arrival, max(1, n)))
    if len(latencies) != len(trace) or core.pool.num_in_use:
        raise RuntimeError(f"{len(trace) - len(latencies)} requests unfinished, {core.pool.num_in_use} blocks held")
    makespan = max(clock - trace[0].arrival, 1e-9)
    return RunResult(
        rate=rate, normalized_latency=sum(e / n for e, n in latencies) / len(latencies),
        mean_latency=sum(e for e, _ in latencies) / len(latencies), throughput=len(trace) / makespan,
        output_tokens_per_s=sum(n for _, n in latencies) / makespan, busy_seconds=busy, max_running=max_running,
        preemptions=core.scheduler.num_preemptions)


def sustained_rate(points: list[tuple[float, float]], bound: float) -> tuple[float, bool]:
    """The highest rate whose normalized latency stays within `bound`, interpolated linearly between the
    last swept rate under it and the first over it; (rate, True) when even the highest swept rate is
    within the bound (the figure is then a lower limit), (0, False) when even the lowest is over it."""
    points = sorted(points)
    best = 0.0
    for i, (rate, lat) in enumerate(points):
        if lat > bound:
            if i == 0:
                return 0.0, False
            r0, l0 = points[i - 1]
            return r0 + (rate - r0) * (bound - l0) / (lat - l0), False
        best = rate
    return best, True
