"""How the scheduler reaches an engine: the Executor protocol and its in-process implementation.

The remote implementation (step protocol over TCP) lives in services.transport; both look the same to
the engine core, so the continuous-batching loop is one piece of code for every deployment.
"""

from __future__ import annotations

from typing import Protocol

from services.contracts.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    url: str  # where the engine is, for messages
    instance: str | None  # the engine instance this scheduler's state belongs to (set by handshake)

    def handshake(self) -> EngineInfo: ...

    def probe(self, timeout: float = 1.0) -> str | None:
        """The instance id of the engine answering now, or None if none answers."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def reset(self) -> None: ...

    def load_lora(self, path: str) -> dict:
        """Load the LoRA adapter in directory `path`: {"digest", "rank"}; AdapterError when it is bad."""
        ...

    def unload_lora(self, digest: str) -> None: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """Calls a ModelRunner living in this process (offline API, `pagedserve serve`).

    It answers probes like a remote engine that never restarts, so a replica marked unhealthy after an
    engine-wide failure probes it and serves again within a probe interval, as with a remote engine.
    """

    url = "in-process"
    instance = "in-process"

    def __init__(self, runner):
        self.runner = runner

    def probe(self, timeout: float = 1.0) -> str:
        return self.instance

    def handshake(self) -> EngineInfo:
        return self.runner.info

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def reset(self) -> None:
        self.runner.reset()

    def load_lora(self, path: str) -> dict:
        return self.runner.load_lora(path)

    def unload_lora(self, digest: str) -> None:
        self.runner.unload_lora(digest)

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass
