"""The scheduler's Prometheus metrics, under the names of services.contracts.metric_names.

Queue, KV and token counters are read from the engine core's stats at scrape time (one source of
truth, nothing to keep in sync); latency histograms are observed per request by the HTTP layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.contracts import metric_names as M
from services.scheduler.request_output import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _StatsCollector:
    def __init__(self, stats: Callable[[], SchedulerStats | None]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        if s is None:
            return
        yield GaugeMetricFamily(M.REQUESTS_WAITING, "requests queued, not yet scheduled", value=s.num_waiting)
        yield GaugeMetricFamily(M.REQUESTS_RUNNING, "requests in the running batch", value=s.num_running)
        yield GaugeMetricFamily(M.KV_CACHE_USAGE_RATIO, "share of KV blocks in use", value=s.kv_usage)
        for name, doc, value in (
            (M.PREFIX_CACHE_QUERIES, "prompt tokens looked up in the prefix cache", s.prefix_queries),
            (M.PREFIX_CACHE_HITS, "prompt tokens found in the prefix cache", s.prefix_hits),
            (M.PREEMPTIONS, "requests preempted for lack of KV blocks", s.num_preemptions),
            (M.PROMPT_TOKENS, "prompt tokens received", s.prompt_tokens),
            (M.GENERATION_TOKENS, "tokens generated", s.generation_tokens),
            (M.GUIDED_COMPILES, "structured-output grammars compiled", s.guided.compiles),
            (M.GUIDED_COMPILE_SECONDS, "time spent compiling them", s.guided.compile_seconds),
            (M.GUIDED_CACHE_HITS, "constraints served from the compiled-grammar cache", s.guided.cache_hits),
            (M.GUIDED_COMPILE_FAILURES, "constraints refused: do not compile or exceed a limit",
             s.guided.compile_failures),
            (M.GUIDED_MASK_STEPS, "steps with at least one constrained row", s.guided.mask_steps),
            (M.GUIDED_MASK_SECONDS, "time spent computing their token masks", s.guided.mask_seconds),
            (M.GUIDED_CONSTRAINED_ROWS, "sampled rows constrained by a token mask", s.guided.constrained_rows),
            (M.SAMPLED_ROWS, "rows sampled", s.guided.sampled_rows),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if s.spec_decode is not None:
            yield from _spec_decode_families(s.spec_decode)
        if s.expert_tokens:
            experts = CounterMetricFamily(M.MOE_EXPERT_TOKENS, "tokens routed to each expert, over every expert "
                                          "layer", labels=("expert",))
            for e, n in enumerate(s.expert_tokens):
                experts.add_metric((str(e),), n)
            yield experts
        if s.max_loras:
            # vLLM's form: one series whose labels carry the state and whose value is when it was taken.
            info = GaugeMetricFamily(M.LORA_REQUESTS_INFO, "LoRA adapters of running and waiting requests",
                                     labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"))
            info.add_metric((",".join(s.running_loras), ",".join(s.waiting_loras), str(s.max_loras)), time.time())
            yield info


def _spec_decode_families(d):
    for name, doc, value in (
        (M.SPEC_DECODE_NUM_DRAFTS, "Number of spec decoding drafts.", d.num_drafts),
        (M.SPEC_DECODE_NUM_DRAFT_TOKENS, "Number of draft tokens.", d.num_draft_tokens),
        (M.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Number of accepted tokens.", d.num_accepted_tokens),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    per_pos = CounterMetricFamily(M.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, "Accepted tokens per draft position.",
                                  labels=("position",))
    for pos, value in enumerate(d.num_accepted_tokens_per_pos):
        per_pos.add_metric((str(pos),), value)
    yield per_pos
    yield GaugeMetricFamily(M.SPEC_DECODE_KNEE_TOKENS, "step tokens at which a forward pass turns compute-bound "
                            "(measured)", value=d.knee_tokens)


class SchedulerMetrics:
    def __init__(self, stats: Callable[[], SchedulerStats | None]):
        self.registry = CollectorRegistry()  # per app: `serve` and tests run several in one process
        self.ttft = Histogram(M.TIME_TO_FIRST_TOKEN, "time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(M.INTER_TOKEN_LATENCY, "time between two tokens of one sample",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(M.E2E_REQUEST_LATENCY, "time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_StatsCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latency observations of one request, fed with its count of generated tokens after each output."""

    def __init__(self, metrics: SchedulerMetrics | None):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.tokens = 0

    def tokens_now(self, total_tokens: int) -> None:
        if self.metrics is None or total_tokens <= self.tokens:
            return
        now = time.monotonic()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
        else:
            # Tokens arrive in steps; spread the gap over them, as each is one inter-token interval.
            per_token = (now - self.last) / (total_tokens - self.tokens)
            for _ in range(total_tokens - self.tokens):
                self.metrics.itl.observe(per_token)
        self.tokens, self.last = total_tokens, now

    def finished(self) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.monotonic() - self.start)
