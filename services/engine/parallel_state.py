"""One rank's membership in a tensor-parallel group: rendezvous, process groups, collectives, failure.

A group of N ranks serves one model replica. Ranks meet at a rendezvous: `file://<path>` when every
rank runs on one machine (a file in a private directory: nothing listens on the network) or
`tcp://<host>:<port>` when the group spans machines (rank 0 hosts the store on that port). They
connect in two phases: `RankGroup(...)` reaches the store at once, `connect()` waits until every rank
has loaded its weights and then builds the process groups, so a slow load never trips a collective's
timeout.

Collectives run on torch.distributed process groups built directly (not the global default group, so
one process may hold several engines in turn): NCCL for the forward's all-reduces and the logits'
gather on CUDA, gloo on the CPU; rank 0's step broadcasts always go through gloo on host memory. Every
collective has a timeout (`timeout_s`): a rank that died is seen at once (its sockets close), one that
hangs within the timeout; either way `fail()` takes this rank down with a reason, never a hang. NCCL
collectives are asynchronous to the host, so each step ends with `wait_device`, a bounded wait on the
device's work that raises the same group error (never yet run on GPUs: no machine with several was lent).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from services.contracts.step_protocol import EngineUnavailableError

log = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT = 3600.0  # loading a large model's shard and compiling kernels


class RankGroupError(EngineUnavailableError):
    """The tensor-parallel group is down: a rank died, hung or failed mid-step. Every request on the
    engine is lost, as when a single-process engine dies."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: its rank in the group, its index on its machine, the group's rendezvous."""

    rank: int
    size: int
    local_rank: int  # the CUDA device index on its machine
    local_size: int  # ranks on this machine
    rendezvous: str  # file:///path or tcp://host:port

    def __post_init__(self):
        assert 0 <= self.rank < self.size and 0 <= self.local_rank < self.local_size <= self.size, self
        if urlparse(self.rendezvous).scheme not in ("file", "tcp"):
            raise ValueError(f"tensor-parallel rendezvous must be file:///path or tcp://host:port, "
                             f"got {self.rendezvous!r}")

    @property
    def spans_machines(self) -> bool:
        return self.local_size < self.size


def short_error(exc: BaseException) -> str:
    """A collective's error without gloo's source location and advice: "Timed out waiting 3000ms for
    recv operation to complete", "Connection closed by peer [127.0.0.1]:4567"."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(exc))
    return text.split(" This is typically caused")[0].strip() or type(exc).__name__


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `done()` until it is true (True) or `timeout_s` passes (False), sleeping a little longer each
    time from 50 us up to 2 ms, so a step that completes at once costs almost nothing."""
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    return True


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _open_store(place: RankPlace, start_timeout: float):
    url = urlparse(place.rendezvous)
    if url.scheme == "file":
        store = dist.FileStore(url.path, place.size)
        store.set_timeout(_timedelta(start_timeout))
        return store
    if url.port is None:
        raise ValueError(f"tensor-parallel rendezvous {place.rendezvous!r} needs a port")
    # Rank 0 listens; the others retry connecting until start_timeout (rank 0 may still be starting).
    return dist.TCPStore(url.hostname, url.port, place.size, is_master=place.rank == 0,
                         timeout=_timedelta(start_timeout), wait_for_workers=False)


class RankGroup:
    """This rank's process groups and the collectives the engine needs, with a timeout on each."""

    def __init__(self, place: RankPlace, device: torch.device, timeout_s: float,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT):
        if timeout_s <= 0:
            raise ValueError(f"tensor-parallel timeout must be > 0 seconds, got {timeout_s}")
        self.place = place
        self.rank, self.size = place.rank, place.size
        self.device = device
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.store = _open_store(place, start_timeout_s)
        self.cpu_group = None  # gloo: step broadcasts, start-up checks
        self.device_group = None  # NCCL on CUDA; the gloo group on the CPU
        # Rank 0 holds it for a whole step (broadcast + forward) and for each heartbeat, so no two
        # collectives of one group ever interleave.
        self.lock = threading.Lock()
        self.broken: str | None = None
        self._fail_lock = threading.Lock()
        self._on_failure: list[Callable[[str], None]] = []
        self._on_close: list[Callable[[], None]] = []
        # What this rank knows of the others when a collective fails (its child ranks' exit codes).
        self._explain: Callable[[], str | None] | None = None

    # -- start-up --------------------------------------------------------------------------------
    def connect(self) -> None:
        """Wait until every rank has loaded (start timeout), then build the process groups. A rank that
        failed to start (`report_start_failure`) or died (this rank's watchdog: `fail`) ends the wait."""
        self.store.set(f"loaded/{self.rank}", "1")
        deadline = time.monotonic() + self.start_timeout_s
        waiting = list(range(self.size))
        while waiting:
            if self.broken is not None:
                raise RankGroupError(f"tensor-parallel group down: {self.broken}")
            try:
                for r in range(self.size):
                    if self.store.check([f"failed/{r}"]):
                        reason = self.store.get(f"failed/{r}").decode(errors="replace")
                        raise self.fail(f"rank {r} failed to start: {reason}")
                waiting = [r for r in waiting if not self.store.check([f"loaded/{r}"])]
            except RankGroupError:
                raise
            except Exception as exc:  # the store is gone: rank 0 died
                raise self.fail(f"lost the rendezvous during start-up: {exc}") from exc
            if waiting and time.monotonic() > deadline:
                raise self.fail(f"ranks {waiting} did not load within {self.start_timeout_s:.0f}s")
            if waiting:
                time.sleep(0.2)
        gloo_opts = dist.ProcessGroupGloo._Options()
        gloo_opts._timeout = _timedelta(self.timeout_s)
        # One machine: gloo listens on loopback only. Across machines: the interface GLOO_SOCKET_IFNAME
        # names, else the one the hostname resolves to.
        device = (dist.ProcessGroupGloo.create_default_device() if self.place.spans_machines
                  else dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"))
        gloo_opts._devices = [device]
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("tp-cpu", self.store), self.rank, self.size,
                                               gloo_opts)
        if self.device.type == "cuda":
            nccl_opts = dist.ProcessGroupNCCL.Options()
            # NCCL's watchdog aborts the process at its timeout: give it longer than wait_device's deadline,
            # so the bounded wait reports the group error first.
            nccl_opts._timeout = _timedelta(2 * self.timeout_s + 30)
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl", self.store), self.rank,
                                                      self.size, nccl_opts)
        else:
            self.device_group = self.cpu_group

    def report_start_failure(self, reason: str) -> None:
        """Tell the other ranks, waiting in `connect`, that this one will never load (best effort)."""
        try:
            self.store.set(f"failed/{self.rank}", reason[:4000])
        except Exception:
            pass

    # -- collectives -----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (the row-parallel layers' one reduction each)."""
        self.device_group.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of `x` over the group, in place (the absmax of an input that row-parallel
        layers hold split across ranks, for activation scales the checkpoint computes over the whole row)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.device_group.allreduce([x], opts).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape everywhere) on rank 0, in rank order; None on the others."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.device_group.gather(outs, [x], opts).wait()
        return outs[0] if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's host tensor `x` into every rank's `x` (same shape and dtype), through gloo."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.cpu_group.broadcast([x], opts).wait()
        return x

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (same length everywhere), in rank order."""
        mine = torch.tensor(values, dtype=torch.int64)
        outs = [[torch.empty_like(mine) for _ in range(self.size)]]
        self.cpu_group.allgather(outs, [mine]).wait()
        return [t.tolist() for t in outs[0]]

    def wait_device(self, what: str) -> None:
        """Block until this rank's queued device work (the step's NCCL collectives) completes, at most
        `timeout_s`: NCCL work's `.wait()` only orders streams and never blocks the host, so without
        this a dead or hung peer would surface as a hang until NCCL's watchdog aborts the process.
        Past the deadline the group goes down with a clean RankGroupError, as on gloo. No-op off CUDA
        (gloo's waits block and time out themselves)."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        if not wait_until(done.query, self.timeout_s):
            raise self.fail(f"{what}: rank {self.rank}'s collectives did not complete within {self.timeout_s:.0f}s "
                            "(a peer died or hangs)")

    # -- failure ---------------------------------------------------------------------------------
    def on_failure(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` runs once, on the first failure (the engine's: exit the process)."""
        self._on_failure.append(callback)

    def fail(self, reason: str) -> RankGroupError:
        """Mark the group down (first reason wins), run the failure callbacks, and return the error to
        raise. A rank whose collective failed cannot know what the others did: it must not go on."""
        with self._fail_lock:  # the watchdog thread and a failing collective may report at once
            first = self.broken is None
            if first:
                self.broken = reason
        if first:
            log.error("tensor-parallel rank %d of %d: %s", self.rank, self.size, reason)
            for callback in self._on_failure:
                callback(reason)
        return RankGroupError(f"tensor-parallel group down: {self.broken}")

    def explain_failures_with(self, explain: Callable[[], str | None]) -> None:
        self._explain = explain

    def on_close(self, callback: Callable[[], None]) -> None:
        """`callback()` runs at `close()` (last registered first): child ranks, files, CPU shares."""
        self._on_close.append(callback)

    def close(self) -> None:
        while self._on_close:
            callback = self._on_close.pop()
            try:
                callback()
            except Exception:
                log.exception("closing the tensor-parallel group")

    @contextlib.contextmanager
    def exclusive(self, what: str):
        """Run a sequence of collectives as one unit; any exception in it takes the group down."""
        with self.lock:
            if self.broken is not None:
                raise RankGroupError(f"tensor-parallel group down: {self.broken}")
            try:
                yield
            except RankGroupError:
                raise
            except Exception as exc:
                cause = self._explain() if self._explain is not None else None
                raise self.fail(cause or f"{what} failed on rank {self.rank}: {short_error(exc)}") from exc
