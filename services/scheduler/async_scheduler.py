"""The engine core behind asyncio: the step loop runs on its own thread, HTTP handlers await outputs.

Every call into the SchedulerCore happens on the loop thread (adds and aborts are queued and applied
between steps), so the core stays single-threaded. A request's stream yields cumulative
RequestOutputs; leaving the stream early (client gone, task cancelled) aborts the request, which frees
its KV blocks at the next step boundary. If the executor raises, every in-flight request ends with
finish_reason "error" and the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.request_output import RequestOutput, SchedulerStats

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """This replica already holds as many sequences as it may queue; another replica may have room."""


def default_max_waiting(core: SchedulerCore) -> int:
    """Sequences a replica queues beyond its running batch: twice the batch, or more for a big KV cache
    (one sequence per 512 tokens of it), so the router's own queue, which can still pick whichever
    replica frees up first, fills before any replica's does."""
    capacity_tokens = core.info.num_kv_blocks * core.info.block_size
    return max(2 * core.scheduler.config.max_num_seqs, capacity_tokens // 512)


class QueueReservation:
    """The sequences one HTTP request holds in this replica's bounded queue, until it ends."""

    def __init__(self, owner: AsyncScheduler, num_seqs: int):
        self._owner, self.num_seqs = owner, num_seqs

    def release(self) -> None:
        if self._owner is not None:
            self._owner._admitted -= self.num_seqs
            self._owner = None


class AsyncScheduler:
    def __init__(self, core: SchedulerCore, idle_wait: float = 0.5, max_waiting: int | None = None):
        self.core = core
        self.max_waiting = max_waiting if max_waiting is not None else default_max_waiting(core)
        # Counted on the event loop's thread at admission, so a burst cannot overshoot between two steps.
        self.max_in_flight = core.scheduler.config.max_num_seqs + self.max_waiting
        self._admitted = 0
        self._ops: deque[tuple] = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._idle_wait = idle_wait
        self._stats = core.stats()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- client side (event loop thread) ----------------------------------------------------
    def admit(self, num_seqs: int) -> QueueReservation:
        """Hold room for `num_seqs` sequences (released by the caller when the request ends), or raise
        QueueFullError: memory and queueing delay stay bounded whatever arrives."""
        if self._admitted + num_seqs > self.max_in_flight:
            raise QueueFullError(f"{self._admitted} sequences are in flight here and {num_seqs} more would "
                                 f"exceed the limit of {self.max_in_flight} (--max-waiting {self.max_waiting})")
        self._admitted += num_seqs
        return QueueReservation(self, num_seqs)

    @property
    def admitted(self) -> int:
        return self._admitted

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        if request_id in self._streams:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        self.core.validate(prompt_token_ids, params)  # fail fast, before anything is queued
        grammar = None
        if params.structured_outputs is not None:  # compiled on the compiler's threads, never the step loop's
            grammar = await self.core.grammars.compile_async(params.structured_outputs)
            if request_id in self._streams:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        self._ops.append(("add", request_id, list(prompt_token_ids), params, grammar, lora_name))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._ops.append(("abort", request_id))
        self._wake.set()

    def call(self, fn, *args, timeout: float | None = 60.0):
        """Run `fn(*args)` on the loop thread between steps and return its result (blocking).

        For work that must touch the core from another thread, e.g. resetting the prefix cache after
        the engine restarted. Never call it from the loop thread itself.
        """
        done = threading.Event()
        box: dict = {}
        self._ops.append(("call", fn, args, done, box))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError(f"engine loop did not run {getattr(fn, '__name__', fn)} within {timeout}s")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def stats(self) -> SchedulerStats:
        """Snapshot taken after the latest step (never blocks on a running step)."""
        return self._stats

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # -- loop thread --------------------------------------------------------------------------
    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """(request id, output or exception) pairs to their streams, in one wake-up per event loop: a
        call_soon_threadsafe per output would write the loop's self-pipe and contend for the GIL once
        per stream, on the step loop's time between two forward passes."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:  # None: the client left; its abort is queued
                batches.setdefault(target[0], []).append((target[1], item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # that event loop is closed

    def _apply_ops(self) -> None:
        core = self.core
        while self._ops:
            op = self._ops.popleft()
            if op[0] == "add":
                _, rid, prompt, params, grammar, lora_name = op
                if rid not in self._streams:
                    continue  # cancelled before it was queued in the core
                try:
                    core.add_request(rid, prompt, params, stream=True, validated=True, grammar=grammar,
                                     lora_name=lora_name)
                except InvalidRequestError as e:
                    self._deliver([(rid, e)])
                except Exception as e:  # never let one bad request stop the loop
                    log.exception("request %s could not be queued", rid)
                    self._deliver([(rid, e)])
            elif op[0] == "call":
                _, fn, args, done, box = op
                try:
                    box["result"] = fn(*args)
                except Exception as e:  # handed to the caller, which decides what it means
                    box["error"] = e
                done.set()
            else:
                out = core.abort_request(op[1])
                if out is not None:
                    self._deliver([(op[1], out)])

    def _run(self) -> None:
        core = self.core
        while not self._stop:
            self._apply_ops()
            if not core.has_unfinished():
                self._stats = core.stats()
                self._wake.wait(self._idle_wait)
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except Exception as e:
                log.exception("engine step failed; failing %d in-flight requests", len(core.groups))
                outputs = core.fail_all(f"engine failure: {e}")
            self.steps += 1
            self._deliver([(out.request_id, out) for out in outputs])
            self._stats = core.stats()


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
