"""The scheduler's side of the step protocol: an Executor that drives an engine in another process.

Failure is always an exception, never a hang: a killed engine is noticed at once (ZeroMQ's socket
monitor reports the TCP disconnect while a reply is pending), a hung one after `timeout` seconds, and a
restarted one by its new instance id (its KV cache is empty, so the scheduler's bookkeeping is stale).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from services.contracts.internal_auth import InternalToken
from services.contracts.step_protocol import (
    EngineInfo,
    EngineUnavailableError,
    InvalidStepError,
    ModelRunnerOutput,
    SchedulerOutput,
)
from services.model_files.lora_files import AdapterError
from services.transport.wire import WireRequest, decode_reply, encode_request

log = logging.getLogger(__name__)

_POLL_MS = 50


class EngineOpError(RuntimeError):
    """The engine answered, but the operation raised there (the message carries the engine's error)."""


_INFO_FIELDS = {f.name for f in dataclasses.fields(EngineInfo)}


class RemoteExecutor:
    def __init__(self, url: str, timeout: float = 60.0, token: InternalToken | None = None):
        self.url = url
        self.timeout = timeout
        self._auth = token.value if token is not None else None
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe; health() may come from HTTP
        self._ids = itertools.count(1)
        self._instance: str | None = None
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A fixed identity, so the engine knows this scheduler across TCP reconnects (it only takes steps
        # from the scheduler that handshook); a restarted scheduler is a new one and handshakes again.
        self._sock.setsockopt(zmq.IDENTITY, os.urandom(16))
        # Queue nothing for a peer that is not connected: a send then fails at once instead of
        # sitting in a pipe for an engine that may never come.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(url)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    # -- Executor protocol -------------------------------------------------------------------------
    def handshake(self) -> EngineInfo:
        body = self._call("handshake", None, self.timeout, check_instance=False)
        return EngineInfo(**{k: v for k, v in body.items() if k in _INFO_FIELDS})

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput.from_wire(self._call("step", scheduler_output.to_wire(), self.timeout))

    def reset(self) -> None:
        self._call("reset", None, self.timeout)

    def load_lora(self, path: str) -> dict:
        return self._call("load_lora", {"path": path}, self.timeout)

    def unload_lora(self, digest: str) -> None:
        self._call("unload_lora", {"digest": digest}, self.timeout)

    def health(self, timeout: float = 2.0) -> bool:
        try:
            self._call("health", None, timeout, check_instance=False)
            return True
        except (EngineUnavailableError, EngineOpError):
            return False

    def probe(self, timeout: float = 1.0) -> str | None:
        """The instance id of the engine answering now, or None if none answers (restart detection)."""
        try:
            return self._call("health", None, timeout, check_instance=False, want_instance=True)
        except (EngineUnavailableError, EngineOpError):
            return None

    def close(self) -> None:
        with self._lock:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)

    # -- helpers -------------------------------------------------------------------------------------
    @property
    def instance(self) -> str | None:
        """The engine instance this executor's scheduler state belongs to (set by handshake)."""
        return self._instance

    def wait_ready(self, timeout: float) -> EngineInfo:
        """Handshake, retrying until the engine answers: it may still be loading its weights."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.handshake()
            except EngineUnavailableError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _call(self, op: str, body, timeout: float, check_instance: bool = True, want_instance: bool = False):
        with self._lock:
            self._drain_monitor()  # disconnects from before this call are history, not this call's fate
            rid = next(self._ids)
            try:
                self._sock.send(encode_request(WireRequest(id=rid, op=op, body=body, auth=self._auth)), zmq.NOBLOCK)
            except zmq.Again:
                raise EngineUnavailableError(f"engine at {self.url} is not connected") from None
            deadline = time.monotonic() + timeout
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    raise EngineUnavailableError(
                        f"engine at {self.url} did not answer {op!r} in {timeout:g}s")
                events = dict(self._poller.poll(min(remaining_ms, _POLL_MS)))
                if self._monitor in events and self._drain_monitor():
                    raise EngineUnavailableError(f"connection to engine at {self.url} lost during {op!r}")
                if self._sock not in events:
                    continue
                reply = decode_reply(self._sock.recv())
                if reply.id != rid:
                    continue  # the late answer to a call that already timed out
                result = self._accept(op, reply, check_instance)
                return reply.instance if want_instance else result

    def _accept(self, op: str, reply, check_instance: bool):
        if op == "handshake":
            if self._instance is not None and reply.instance != self._instance:
                log.warning("engine at %s restarted (instance %s -> %s)", self.url, self._instance[:8],
                            reply.instance[:8])
            self._instance = reply.instance
        elif check_instance and self._instance is not None and reply.instance != self._instance:
            raise EngineUnavailableError(f"engine at {self.url} restarted; its KV cache is gone")
        if not reply.ok:
            if isinstance(reply.body, dict) and reply.body.get("not_owner"):
                # Another scheduler handshook since: this one's view of the engine is stale.
                self._instance = None
                raise EngineUnavailableError(f"engine at {self.url}: {reply.error}")
            if isinstance(reply.body, dict) and reply.body.get("adapter_field"):
                raise AdapterError(str(reply.body["adapter_field"]), str(reply.error))
            if isinstance(reply.body, dict) and reply.body.get("bad_seq_ids"):
                raise InvalidStepError(f"engine refused the step: {reply.error}", reply.body["bad_seq_ids"])
            raise EngineOpError(f"engine {op!r} failed: {reply.error}")
        return reply.body

    def _drain_monitor(self) -> bool:
        """Consume pending monitor events; True if any was a disconnect."""
        lost = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
        return lost
