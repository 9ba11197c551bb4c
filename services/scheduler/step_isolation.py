"""Running a step so that a failure tied to some requests costs only those requests.

When the engine raises on a step, the cause is either the engine (dead, restarted, hung: every request
on it is lost, and `EngineUnavailableError` says so) or something about particular sequences. The engine
may name them (`InvalidStepError`, raised before any kernel reads memory); otherwise the step is split
in halves and each half run again, recursively, until every failing sequence is alone: O(k log n) extra
steps for k culprits in a batch of n, paid only when something failed. Re-running is safe: a step's KV
writes land in the slots the scheduler allocated for it and the same writes repeat, and copy-on-write
copies read blocks nobody writes. When every sequence of the step fails alone too, a canary (one known-
good token in a spare block) tells an engine that fails for everyone from requests that all fail on
their own; if the canary fails as well, the engine is the cause after all and the original error is
raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.contracts.step_protocol import (
    EngineUnavailableError,
    InvalidStepError,
    ModelRunnerOutput,
    SchedulerOutput,
)
from services.scheduler.executor import Executor

log = logging.getLogger(__name__)


@dataclass
class IsolatedStep:
    result: ModelRunnerOutput
    failed: dict[str, str] = field(default_factory=dict)  # seq_id -> why its request failed


def execute_isolating(executor: Executor, out: SchedulerOutput, canary: Callable[[], bool]) -> IsolatedStep:
    """`canary()` runs a known-good step and says whether the engine still computes at all."""
    try:
        return IsolatedStep(executor.execute(out))
    except EngineUnavailableError:
        raise
    except Exception as exc:
        first = exc
    log.warning("step %d (%d sequences) failed (%s: %s); isolating the sequences that cause it", out.step_id,
                len(out.sequences), type(first).__name__, first)
    step = _isolate(executor, out, first)
    if len(step.failed) == len(out.sequences) and not canary():
        raise first  # nothing runs, not even the canary: the engine is broken, not the requests
    for seq_id, why in step.failed.items():
        log.error("step %d: sequence %s fails its request: %s", out.step_id, seq_id, why)
    return step


def _isolate(executor: Executor, out: SchedulerOutput, exc: Exception) -> IsolatedStep:
    ids = {s.seq_id for s in out.sequences}
    named = set(exc.seq_ids) & ids if isinstance(exc, InvalidStepError) else set()
    if named:
        step = _run(executor, _subset(out, [s for s in out.sequences if s.seq_id not in named]))
        step.failed.update({sid: str(exc) for sid in named})
        return step
    if len(out.sequences) == 1:
        return IsolatedStep(ModelRunnerOutput(out.step_id), {out.sequences[0].seq_id: f"{type(exc).__name__}: {exc}"})
    half = len(out.sequences) // 2
    left = _run(executor, _subset(out, out.sequences[:half]))
    right = _run(executor, _subset(out, out.sequences[half:]))
    left.result.sampled.update(right.result.sampled)
    left.result.logprobs.update(right.result.logprobs)
    left.result.draft_token_ids.update(right.result.draft_token_ids)
    left.failed.update(right.failed)
    return left


def _run(executor: Executor, out: SchedulerOutput) -> IsolatedStep:
    if not out.sequences:
        return IsolatedStep(ModelRunnerOutput(out.step_id))
    try:
        return IsolatedStep(executor.execute(out))
    except EngineUnavailableError:
        raise
    except Exception as exc:
        return _isolate(executor, out, exc)


def _subset(out: SchedulerOutput, sequences) -> SchedulerOutput:
    # Every part carries the step's copy-on-write copies: each is idempotent and some part needs it.
    return replace(out, sequences=list(sequences))
