"""One system serving one Poisson trace on the real engine, timed step by step on a virtual clock, and
the judgement of whether it sustained the trace's rate.

Every step runs the real scheduler and the real model on this machine and advances the clock by what
it cost (services.bench.paper.step_cost: measured here, or modeled for the paper's GPU); requests join when
the clock passes their arrival. When nothing is in flight the clock jumps to the next arrival instead
of sleeping, so a run costs only the time the engine computes, while queueing, batching and every
step's cost are the clock's.

Steady state: a trace is as long in time at every rate (services.bench.paper.rate_search sizes it), the
requests arriving in its first half warm the system up and are not judged, and a rate is sustained only
if (1) the mean normalized latency of the requests arriving in the second half is within the bound,
and (2) the requests in the system (arrived, not finished), averaged over the trace's last quarter, are
at most 1.25 x their average over the third quarter plus 2: a queue that still grows is not a steady
state, whatever the latency says so far (by Little's law a latency still climbing is a queue still
growing; the queue is the steadier signal, a time average rather than a mean over a dozen requests of
very different lengths). The latencies of the third and last quarters' arrivals are reported beside
it, as the latency's own trend.
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

# Steady-state test (2) above: the last quarter's mean requests in the system against the third's.
QUEUE_GROWTH = 1.25
QUEUE_SLACK = 2.0


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


# RunResult fields in units of the run's clock (seconds of it, or per second of it): named with the clock's
# kind ("measured_..." or "modeled_...") wherever they are written out, so a modeled figure never reads as
# a measured one.
CLOCKED = ("rate", "trace_seconds", "normalized_latency", "window_latency", "third_quarter_latency",
           "last_quarter_latency", "mean_latency", "throughput", "output_tokens_per_s", "busy_seconds")


@dataclass
class RunResult:
    rate: float  # offered, requests per clock second (inf: all at once)
    requests: int
    trace_seconds: float  # the last arrival's time
    normalized_latency: float  # mean over all requests of end-to-end seconds / output tokens
    window_latency: float  # the same over the requests arriving in the trace's second half
    third_quarter_latency: float  # ... arriving in its third quarter
    last_quarter_latency: float  # ... arriving in its last quarter
    third_quarter_in_system: float  # requests arrived and not finished, time-averaged over the third quarter
    last_quarter_in_system: float  # ... over the last quarter
    mean_latency: float  # seconds
    throughput: float  # requests served per second: requests / time from the first arrival to the last finish
    output_tokens_per_s: float
    busy_seconds: float  # engine + scheduler time the run took, on the run's clock
    max_running: int
    preemptions: int

    def verdict(self, bound: float) -> tuple[bool, str]:
        """Whether the run sustained its rate under `bound` (the module's two tests), and why not."""
        if not self.window_latency <= bound:
            return False, f"second-half latency {self.window_latency:.4g} > bound"
        limit = QUEUE_GROWTH * self.third_quarter_in_system + QUEUE_SLACK
        if self.last_quarter_in_system > limit:
            return False, (f"queue still growing: {self.last_quarter_in_system:.1f} in the system in the last "
                           f"quarter against {self.third_quarter_in_system:.1f} in the third")
        return True, "steady and within the bound"

    def as_dict(self, clock: str) -> dict:
        """The fields, those on the clock named `{clock}_<field>`."""
        out = {}
        for k, v in self.__dict__.items():
            v = round(v, 5) if isinstance(v, float) and math.isfinite(v) else v
            out[f"{clock}_{k}" if k in CLOCKED else k] = v
        return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def serve_trace(core: SchedulerCore, trace: list[TraceRequest], rate: float, on_step=None,
                step_cost=MeasuredStep(time.perf_counter, "measured: wall time")) -> RunResult:
    pending = deque(sorted(trace, key=lambda r: r.arrival))
    info: dict[str, TraceRequest] = {}
    clock = busy = 0.0
    span = max(r.arrival for r in trace)
    quarter = span / 4
    in_system = [0.0] * 4  # integral of requests in the system over each quarter of the arrival span
    finished: list[tuple[float, float, int]] = []  # (arrival, end-to-end seconds, output tokens)
    max_running = 0
    while pending or core.has_unfinished():
        if not core.has_unfinished() and pending[0].arrival > clock:
            clock = pending[0].arrival
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            info[r.request_id] = r
            core.add_request(r.request_id, r.prompt_token_ids,
                             SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
        inside = len(info) - len(finished)
        outputs, dt = step_cost.run(core)
        if quarter > 0 and clock < span:
            in_system[min(3, int(clock / quarter))] += inside * dt
        clock += dt
        busy += dt
        max_running = max(max_running, len(core.scheduler.running))
        if on_step is not None:
            on_step(core)
        for out in outputs:
            if out.finished:
                n = len(out.outputs[0].token_ids)
                arrival = info[out.request_id].arrival
                finished.append((arrival, clock - arrival, max(1, n)))
    if len(finished) != len(trace) or core.pool.num_in_use:
        raise RuntimeError(f"{len(trace) - len(finished)} requests unfinished, {core.pool.num_in_use} blocks held")

    def latency(start: float, end: float) -> float:
        return _mean([e / n for a, e, n in finished if start * span <= a <= end * span])

    makespan = max(clock - trace[0].arrival, 1e-9)
    return RunResult(
        rate=rate, requests=len(trace), trace_seconds=span,
        normalized_latency=_mean([e / n for _, e, n in finished]), window_latency=latency(0.5, 1.0),
        third_quarter_latency=latency(0.5, 0.75), last_quarter_latency=latency(0.75, 1.0),
        third_quarter_in_system=in_system[2] / quarter if quarter else 0.0,
        last_quarter_in_system=in_system[3] / quarter if quarter else 0.0,
        mean_latency=_mean([e for _, e, _ in finished]), throughput=len(trace) / makespan,
        output_tokens_per_s=sum(n for _, _, n in finished) / makespan, busy_seconds=busy, max_running=max_running,
        preemptions=core.scheduler.num_preemptions)
