"""The ranks of a tensor-parallel group on one machine, as child processes of that machine's first rank.

The first rank of a machine (rank 0, the engine that serves the step protocol, or the first rank of a
worker machine) starts the machine's other ranks as `pagedserve engine-worker` processes and watches
them: when one exits, the group is down and the first rank goes down too (its supervisor, `up`,
`serve` or the kubelet, restarts the whole group). Each child dies with its starter (PR_SET_PDEATHSIG
with SIGKILL: a rank must never outlive the group, least of all one stuck in a collective) and runs
in a session of its own, so a terminal's Ctrl-C reaches only the first rank, which stops the rest.

On the CPU every rank of the machine gets its own slice of the cores it may use, with one torch
thread per core of the slice (or fewer when OMP_NUM_THREADS caps the whole group): two ranks
sharing cores would each run at half speed and then wait for each other in every all-reduce.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_WATCH_INTERVAL = 0.1


@dataclass(frozen=True)
class CpuShare:
    cpus: tuple[int, ...]
    threads: int


def cpu_shares(local_size: int) -> list[CpuShare]:
    """One slice of this process's CPUs per local rank; with fewer CPUs than ranks, all of them for
    each rank but one thread each (more would spin against the other ranks on the same cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < local_size:
        return [CpuShare(tuple(cpus), 1)] * local_size
    per = len(cpus) // local_size
    budget = os.environ.get("OMP_NUM_THREADS")
    threads = per if not (budget and budget.isdigit()) else max(1, min(per, int(budget) // local_size))
    return [CpuShare(tuple(cpus[i * per:(i + 1) * per]), threads) for i in range(local_size)]


class OwnShare:
    """This process's own share (the first rank's), restored on `restore()` (an offline LLM's process
    must get its cores back when its engine closes)."""

    def __init__(self, share: CpuShare | None):
        import torch

        self.share = share
        self.saved = (os.sched_getaffinity(0), torch.get_num_threads())
        if share is not None:
            os.sched_setaffinity(0, share.cpus)
            torch.set_num_threads(share.threads)

    def restore(self) -> None:
        import torch

        if self.share is not None:
            os.sched_setaffinity(0, self.saved[0])
            torch.set_num_threads(self.saved[1])


def _child_setup(share: CpuShare | None) -> Callable[[], None]:
    def setup() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        os.setsid()
        if share is not None:
            os.sched_setaffinity(0, share.cpus)

    return setup


def _log_level() -> str:
    name = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    return name if name in ("debug", "info", "warning", "error") else "info"


class LocalRanks:
    """Child rank processes of this machine, watched from a thread."""

    def __init__(self, procs: dict[int, subprocess.Popen]):
        self.procs = procs  # rank -> process
        self._stopping = False

    @classmethod
    def start(cls, flags: list[str], *, node_rank: int, first_rank: int, local_size: int,
              shares: list[CpuShare] | None) -> LocalRanks:
        """Start local ranks 1..local_size-1 of `node_rank` (`flags`: the engine config's, rendezvous
        included); `first_rank` is the machine's local rank 0."""
        procs = {}
        for local in range(1, local_size):
            share = shares[local] if shares else None
            env = dict(os.environ)
            if share is not None:
                env["OMP_NUM_THREADS"] = str(share.threads)
            argv = [sys.executable, "-m", "services.commands.cli", "engine-worker", *flags, "--tp-node-rank",
                    str(node_rank),
                    "--tp-local-rank", str(local), "--log-level", _log_level()]
            procs[first_rank + local] = subprocess.Popen(argv, env=env, preexec_fn=_child_setup(share))
        return cls(procs)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(reason)` once, as soon as any rank exits (unless we are stopping them)."""

        def loop() -> None:
            while not self._stopping:
                reason = self.exited(wait=0)
                if reason is not None and not self._stopping:
                    on_exit(reason)
                    return
                time.sleep(_WATCH_INTERVAL)

        threading.Thread(target=loop, name="tp-rank-watch", daemon=True).start()

    def exited(self, wait: float = 1.0) -> str | None:
        """Which rank exited and how, if one did (waiting up to `wait` seconds: a collective sees a dead
        rank's socket close a moment before its exit can be reaped)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    return f"rank {rank} (pid {proc.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def kill(self) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float) -> None:
        """Wait for ranks told to shut down; kill what is still there after `timeout`."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not stop in %.0fs; killing it", rank, timeout)
                proc.kill()
                proc.wait()
