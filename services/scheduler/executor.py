"""How the scheduler reaches an engine: the Executor protocol and its in-process implementation.

The remote implementation (step protocol over TCP) lives in services.transport; both look the same to
the engine core, so the continuous-batching loop is one piece of code for every deployment.
"""

from __future__ import annotations

from typing import Protocol

from services.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def handshake(self) -> EngineInfo: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def reset(self) -> None: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """Calls a ModelRunner living in this process (offline API, `pagedserve serve`)."""

    def __init__(self, runner):
        self.runner = runner

    def handshake(self) -> EngineInfo:
        return self.runner.info

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def reset(self) -> None:
        self.runner.reset()

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass
