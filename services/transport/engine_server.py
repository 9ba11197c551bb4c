"""The engine service's network face: serves the step protocol for one model runner over ZeroMQ.

A ROUTER socket answers handshake, step, reset and health, one message at a time: the engine runs one
forward pass at a time anyway, and a single scheduler drives it. The server makes no scheduling
decision; it decodes a `SchedulerOutput`, runs it, and encodes the `ModelRunnerOutput`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Protocol

import zmq

from services.contracts.internal_auth import InternalToken
from services.contracts.step_protocol import EngineInfo, InvalidStepError, ModelRunnerOutput, SchedulerOutput
from services.model_files.lora_files import AdapterError
from services.transport.wire import WireReply, decode_request, encode_reply

log = logging.getLogger(__name__)

_POLL_MS = 100  # how often the loop looks at its stop flag


class StepRunner(Protocol):
    """What the server needs of a model runner (services.engine.model_runner.ModelRunner fits)."""

    @property
    def info(self) -> EngineInfo: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def reset(self) -> None: ...

    def load_lora(self, path: str) -> dict: ...

    def unload_lora(self, digest: str) -> None: ...


class EngineServer:
    def __init__(self, runner: StepRunner, bind_url: str, token: InternalToken | None = None):
        self.runner = runner
        # Changes on every engine start and every reset: the scheduler then knows its bookkeeping of what
        # the KV cache holds is stale (a reset zeroes the cache as a restart empties it).
        self.instance = uuid.uuid4().hex
        self.token = token  # required of every message when set (an engine bound beyond loopback)
        # Only the scheduler that last handshook may run steps or reset: anyone else reaching the port
        # (another local process) can ask for health, nothing more.
        self.owner: bytes | None = None
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind_url)
        self.url = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self.steps_served = 0

    def serve_forever(self) -> None:
        log.info("engine step server listening on %s (instance %s)", self.url, self.instance[:8])
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                identity, data = self._sock.recv_multipart()[:2]
                self._sock.send_multipart([identity, self._handle(identity, data)])
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        self._stop.set()

    def _handle(self, identity: bytes, data: bytes) -> bytes:
        try:
            req = decode_request(data)
        except Exception as exc:  # a garbled frame must not take the engine down
            log.warning("undecodable step-protocol message (%d bytes): %s", len(data), exc)
            return encode_reply(WireReply(id=-1, ok=False, instance=self.instance, error=f"bad message: {exc}"))
        if self.token is not None and not self.token.accepts(req.auth):
            log.warning("refused %r from a caller without this engine's token", req.op)
            return encode_reply(WireReply(id=req.id, ok=False, instance=self.instance,
                                          error="unauthorized: missing or wrong internal token"))
        if req.op in ("step", "reset", "load_lora", "unload_lora") and identity != self.owner:
            return encode_reply(WireReply(id=req.id, ok=False, instance=self.instance, body={"not_owner": True},
                                          error=f"{req.op!r} refused: only the scheduler that handshook may send it"))
        if req.op == "handshake":
            self.owner = identity
        try:
            body = self._dispatch(req.op, req.body)
            return encode_reply(WireReply(id=req.id, ok=True, instance=self.instance, body=body))
        except AdapterError as exc:  # a bad adapter: the scheduler answers 400 naming the field
            return encode_reply(WireReply(id=req.id, ok=False, instance=self.instance, error=exc.message,
                                          body={"adapter_field": exc.field}))
        except InvalidStepError as exc:  # the scheduler fails just these sequences' requests
            log.warning("refused step %d: %s", req.id, exc)
            return encode_reply(WireReply(id=req.id, ok=False, instance=self.instance, error=str(exc),
                                          body={"bad_seq_ids": exc.seq_ids}))
        except Exception as exc:
            log.exception("engine op %r (request %d) failed", req.op, req.id)
            return encode_reply(WireReply(id=req.id, ok=False, instance=self.instance,
                                      error=f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, op: str, body):
        if op == "step":
            out = self.runner.execute(SchedulerOutput.from_wire(body))
            self.steps_served += 1
            return out.to_wire()
        if op == "handshake":
            return self.runner.info.to_wire()
        if op == "health":
            return {"healthy": True, "steps_served": self.steps_served}
        if op == "load_lora":
            return self.runner.load_lora(str(body["path"]))
        if op == "unload_lora":
            self.runner.unload_lora(str(body["digest"]))
            return None
        if op == "reset":
            self.runner.reset()
            self.instance = uuid.uuid4().hex  # what the scheduler knew is cached is gone
            return None
        raise ValueError(f"unknown op {op!r}")
