"""KV efficiency and scheduler cost, observed step by step while a benchmark runs.

Efficiency = KV slots holding live tokens / slots in allocated blocks, counting a shared block once.
It is read at the step where the most blocks are allocated (the peak), the moment that decides how many
requests fit. Scheduler CPU time per step is everything a step costs except the engine's execution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepObserver:
    peak_blocks: int = 0
    efficiency_at_peak: float = 0.0
    steps: int = 0
    sched_seconds: float = 0.0
    exec_seconds: float = 0.0
    max_running: int = 0
    _t_exec: list[float] = field(default_factory=list)

    def wrap_executor(self, executor) -> None:
        """Time the executor so the rest of each step can be charged to the scheduler."""
        inner = executor.execute

        def timed(out):
            t = time.perf_counter()
            try:
                return inner(out)
            finally:
                self._t_exec.append(time.perf_counter() - t)

        executor.execute = timed

    def observe(self, core, step_seconds: float) -> None:
        exec_s = sum(self._t_exec)
        self._t_exec.clear()
        self.steps += 1
        self.exec_seconds += exec_s
        self.sched_seconds += step_seconds - exec_s
        self.max_running = max(self.max_running, len(core.scheduler.running))
        used = core.pool.num_in_use
        if used >= self.peak_blocks and used:
            self.peak_blocks = used
            self.efficiency_at_peak = live_slots(core) / (used * core.kv.block_size)

    @property
    def sched_ms_per_step(self) -> float:
        return 1000 * self.sched_seconds / max(1, self.steps)


def live_slots(core) -> int:
    bs = core.kv.block_size
    filled: dict[int, int] = {}
    for req in core.scheduler.running:
        table = core.kv.tables.get(req.seq_id, ())
        for i, block in enumerate(table):
            n = min(bs, req.num_computed_tokens - i * bs)
            if n > filled.get(block.block_id, 0):
                filled[block.block_id] = n
    return sum(filled.values())
