"""Rank 0 tells the other ranks what to run: each step's validated host-side inputs, LoRA adapter
changes, reset, heartbeat, shutdown.

Rank 0 alone speaks the step protocol: it validates the `SchedulerOutput` and lays it out as one
host buffer (services/engine/step_inputs.py), then broadcasts that buffer, so the other ranks never
parse, validate or trust scheduler input and run exactly rank 0's layout. A message is a fixed-size
gloo broadcast: a header of int64 fields (what the layout needs to be rebuilt) with the buffer inline
when it fits (every decode step of a normal batch), else a second broadcast carries it. A step with
LoRA tokens carries its (slot, first token, end token) segments after the buffer; a LORA message
carries encoded adapter commands (services/engine/lora/commands.py), sent before the step that needs
them.

While idle, rank 0 sends a heartbeat every `heartbeat_s`, so the other ranks can give every receive
a timeout: a rank 0 that died or hangs is noticed by them within `RankGroup.timeout_s`, and a rank
that died is noticed by rank 0 at its next send (gloo sees the socket close).
"""

from __future__ import annotations

import enum
import threading
import time

import numpy as np
import torch

from services.engine.parallel_state import RankGroup
from services.engine.step_inputs import StepInputs
from services.engine.step_layout import StepLayout


class Op(enum.IntEnum):
    STEP = 1
    RESET = 2
    HEARTBEAT = 3
    SHUTDOWN = 4
    LORA = 5


_FIELDS = ("op", "seq", "nbytes", "num_tokens", "num_samples", "num_decode", "decode_width", "num_prefill",
           "prefill_width", "num_copies", "decode_max_context_len", "prefill_max_query_len",
           "prefill_max_context_len", "graph_batch", "num_real_decodes", "num_lora_segments", "num_groups")
_HEADER_BYTES = 8 * 24
INLINE_BYTES = 16384  # a decode step of 64 sequences with 4k-token contexts needs ~6 KiB
MESSAGE_BYTES = _HEADER_BYTES + INLINE_BYTES
assert len(_FIELDS) <= _HEADER_BYTES // 8


def _layout_of(h: dict[str, int]) -> StepLayout:
    return StepLayout.of(num_tokens=h["num_tokens"], num_samples=h["num_samples"], num_decode=h["num_decode"],
                         decode_width=h["decode_width"], num_prefill=h["num_prefill"],
                         prefill_width=h["prefill_width"], num_copies=h["num_copies"], num_groups=h["num_groups"])


def _header_of(step: StepInputs) -> dict[str, int]:
    shapes = step.layout.shapes
    return {"nbytes": step.layout.nbytes, "num_tokens": step.num_tokens, "num_samples": shapes["sample_idx"][0],
            "num_decode": step.num_decode, "decode_width": shapes["decode_block_tables"][2],
            "num_prefill": shapes["prefill_context_lens"][0], "prefill_width": shapes["prefill_block_tables"][2],
            "num_groups": shapes["slot_mapping"][0],
            "num_copies": step.num_copies, "decode_max_context_len": step.decode_max_context_len,
            "prefill_max_query_len": step.prefill_max_query_len,
            "prefill_max_context_len": step.prefill_max_context_len,
            "graph_batch": -1 if step.graph_batch is None else step.graph_batch,
            "num_real_decodes": step.num_real_decodes, "num_lora_segments": len(step.lora_segments)}


class StepSender:
    """Rank 0's side. Callers hold `group.exclusive(...)` around a send and the forward that follows."""

    def __init__(self, group: RankGroup, heartbeat_s: float):
        assert group.rank == 0
        self.group = group
        self.heartbeat_s = heartbeat_s
        self._message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        self._fields = self._message[:_HEADER_BYTES].numpy().view(np.int64)  # written in one assignment
        self._seq = 0
        self.last_sent = time.monotonic()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._shut = False

    def _send(self, op: Op, header: dict[str, int] | None = None, payload: torch.Tensor | None = None) -> None:
        self._seq += 1
        values = {"op": int(op), "seq": self._seq, **(header or {})}
        self._fields[:len(_FIELDS)] = [values.get(name, 0) for name in _FIELDS]
        inline = payload is not None and payload.numel() <= INLINE_BYTES
        if inline:
            self._message[_HEADER_BYTES:_HEADER_BYTES + payload.numel()].copy_(payload)
        self.group.broadcast(self._message)
        if payload is not None and not inline:
            self.group.broadcast(payload)
        self.last_sent = time.monotonic()

    def send_step(self, step: StepInputs) -> None:
        payload = step.host
        if step.lora_segments:
            segments = torch.tensor(step.lora_segments, dtype=torch.int64).view(torch.uint8).view(-1)
            payload = torch.cat([payload, segments])
        self._send(Op.STEP, _header_of(step), payload)

    def send_lora(self, commands: bytes) -> None:
        self._send(Op.LORA, {"nbytes": len(commands)}, torch.frombuffer(bytearray(commands), dtype=torch.uint8))

    def send(self, op: Op) -> None:
        self._send(op)

    def shutdown(self) -> None:
        """Tell the other ranks to exit, then close the group (idempotent; nothing is sent to a group
        that is already down)."""
        self.stop_heartbeat()
        if self.group.broken is None and not self._shut:
            self._shut = True
            try:
                with self.group.exclusive("shutdown"):
                    self.send(Op.SHUTDOWN)
            except Exception:  # logged by the group; its ranks are gone either way
                pass
        self.group.close()

    # -- heartbeat -------------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(5)

    def _heartbeat(self) -> None:
        group = self.group
        while not self._stop.wait(min(0.5, self.heartbeat_s)):
            if group.broken is not None:
                return
            if time.monotonic() - self.last_sent < self.heartbeat_s:
                continue
            try:
                with group.exclusive("heartbeat"):
                    if not self._stop.is_set():
                        self.send(Op.HEARTBEAT)
            except Exception:  # the failure is the group's now; its callbacks ran
                return


class StepReceiver:
    """Every other rank's side: the next message, and the step it carries rebuilt on this rank."""

    def __init__(self, group: RankGroup, pin: bool):
        assert group.rank != 0
        self.group = group
        self.pin = pin
        self._message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        self._fields = self._message[:_HEADER_BYTES].view(torch.int64)
        self._seq = 0

    def _payload(self, nbytes: int, pin: bool) -> torch.Tensor:
        # A fresh buffer per message: on CUDA the previous step's copy to the device may still read its own.
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        if nbytes <= INLINE_BYTES:
            buf.copy_(self._message[_HEADER_BYTES:_HEADER_BYTES + nbytes])
        else:
            self.group.broadcast(buf)
        return buf

    def next(self) -> tuple[Op, StepInputs | bytes | None]:
        """(op, what it carries: the step of a STEP, the encoded commands of a LORA, else None)."""
        self.group.broadcast(self._message)
        h = dict(zip(_FIELDS, self._fields.tolist(), strict=False))
        self._seq += 1
        assert h["seq"] == self._seq, f"tensor-parallel message {h['seq']} arrived, {self._seq} expected"
        op = Op(h["op"])
        if op is Op.LORA:
            return op, self._payload(h["nbytes"], False).numpy().tobytes()
        if op is not Op.STEP:
            return op, None
        layout = _layout_of(h)
        nbytes = h["nbytes"]
        assert layout.nbytes == nbytes, f"step layout of {layout.nbytes} bytes announced as {nbytes}"
        buf = self._payload(nbytes + 24 * h["num_lora_segments"], self.pin)
        host = buf[:nbytes]
        segments = [tuple(s) for s in buf[nbytes:].view(torch.int64).view(-1, 3).tolist()]
        views = layout.host_views(host.numpy())
        spans: list[tuple[int, int, int]] = []
        if h["num_prefill"]:
            bounds = views["prefill_query_start_loc"].tolist()
            ctx = views["prefill_context_lens"].tolist()
            spans = [(bounds[i], bounds[i + 1], ctx[i]) for i in range(len(ctx))]
        graph = None if h["graph_batch"] < 0 else h["graph_batch"]
        return op, StepInputs(layout, host, h["num_tokens"], h["num_decode"], h["decode_max_context_len"],
                              h["prefill_max_query_len"], h["prefill_max_context_len"], spans, [], [],
                              num_copies=h["num_copies"], graph_batch=graph, num_real_decodes=h["num_real_decodes"],
                              lora_segments=segments)

