"""What one engine step costs on `bench paper`'s virtual clock: measured here, or modeled for the paper's GPU.

Every clock has a `kind`, "measured" or "modeled", and every figure on it is written out under that
kind (services.bench.paper.serve.CLOCKED): a modeled rate or latency is never named like a measured one.

Measured (`cpu`): the step's CPU time at one torch thread (other processes' load does not inflate it),
else its wall time. On a CPU a step's cost grows about linearly with the batch, so compute, not KV
memory, caps the batch early, which hides what paging buys (the vLLM paper's gains come from GPUs, where
a step costs about the same at batch 8 as at 64).

Modeled (`a100-opt13b`): the vLLM paper's setup, OPT-13B in FP16 on one A100-40GB, as an **uncalibrated
roofline**: no figure of it was fitted to a measurement of an A100, and it has no per-step overhead
(kernel launches, sampling, the scheduler), so it flatters small batches. A step reads every weight once
(26 GB at 1.5 TB/s: 17 ms) or computes its tokens (26 GFLOP per new token at 190 TFLOP/s sustained, plus
attention's 4 x 40 layers x 5120 FLOPs per attended context token), whichever is longer, and reads the
KV of every context token it attends to (2 x 40 layers x 5120 x 2 bytes = 0.82 MB at 1.5 TB/s: 0.55 us).
The workload's lengths are scaled down by `scale`, so a context token or a prompt token stands for
1/scale of the paper's (a decode step still makes one token per sequence). The real engine still runs
every step (the schedule, the KV pool, the outputs are real); only the clock is the model's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.contracts.step_protocol import SchedulerOutput

# OPT-13B FP16 on one A100-40GB: 40 layers, hidden 5120.
LAYERS, HIDDEN = 40, 5120
WEIGHT_READ_S = 26e9 / 1.5e12
FLOPS = 190e12
COMPUTE_S_PER_TOKEN = 2 * 13e9 / FLOPS
ATTENTION_S_PER_CONTEXT_TOKEN = 4 * LAYERS * HIDDEN / FLOPS  # QK^T and PV, per (new token, attended token)
KV_READ_S_PER_TOKEN = 2 * LAYERS * HIDDEN * 2 / 1.5e12

STEP_COSTS = ("cpu", "a100-opt13b")


@dataclass(frozen=True)
class MeasuredStep:
    clock_fn: Callable[[], float]
    name: str
    kind: str = "measured"

    def run(self, core) -> tuple[list, float]:
        t0 = self.clock_fn()
        outputs = core.step()
        return outputs, self.clock_fn() - t0


@dataclass(frozen=True)
class ModeledA100Step:
    scale: float
    name: str = ("modeled: OPT-13B FP16 on one A100-40GB, an uncalibrated roofline (no per-step overhead), "
                 "over real engine steps")
    kind: str = "modeled"

    def cost(self, out: SchedulerOutput | None) -> float:
        if out is None or not out.sequences:
            return 0.0
        new = attended = context = 0.0
        for s in out.sequences:
            n, start = len(s.token_ids), s.start_pos
            # A prompt chunk stands for a 1/scale longer one; a decode is one token at any scale.
            m = n / self.scale if n > 1 else 1
            first = start / self.scale
            new += m
            attended += m * first + m * (m + 1) / 2  # each new token attends to everything before it and itself
            context += (start + n) / self.scale
        compute = COMPUTE_S_PER_TOKEN * new + ATTENTION_S_PER_CONTEXT_TOKEN * attended
        return max(WEIGHT_READ_S, compute) + KV_READ_S_PER_TOKEN * context

    def run(self, core) -> tuple[list, float]:
        outputs = core.step()
        return outputs, self.cost(core.last_output)


def make_step_cost(kind: str, torch_threads: int, scale: float):
    if kind == "a100-opt13b":
        return ModeledA100Step(scale)
    if kind != "cpu":
        raise ValueError(f"unknown step cost {kind!r}; choose one of {', '.join(STEP_COSTS)}")
    if torch_threads == 1:
        return MeasuredStep(time.process_time, "measured: CPU time (1 torch thread)")
    return MeasuredStep(time.perf_counter, "measured: wall time")
