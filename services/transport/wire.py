"""The step protocol's envelope: what one request and one reply between scheduler and engine look like.

A request is `{"id": n, "op": name, "body": payload}`; a reply is `{"id": n, "ok": bool, "body": payload,
"error": str, "instance": engine_instance_id}`. The id lets a client drop a late reply to a request it
already gave up on; the instance id (random per engine process) lets it notice that the engine was
restarted between two steps, which means every KV block the scheduler thinks is cached is gone.
Payloads are the `to_wire()` dicts of `services.contracts.step_protocol`, encoded with msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

OPS = ("handshake", "step", "reset", "health")


@dataclass(slots=True)
class WireRequest:
    id: int
    op: str
    body: Any = None
    auth: str | None = None  # the internal token, when the engine requires one


@dataclass(slots=True)
class WireReply:
    id: int
    ok: bool
    instance: str
    body: Any = None
    error: str = ""


def encode_request(req: WireRequest) -> bytes:
    return msgpack.packb({"id": req.id, "op": req.op, "body": req.body, "auth": req.auth}, use_bin_type=True)


def decode_request(data: bytes) -> WireRequest:
    d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    auth = d.get("auth")
    return WireRequest(id=int(d["id"]), op=str(d["op"]), body=d.get("body"),
                       auth=auth if isinstance(auth, str) else None)


def encode_reply(rep: WireReply) -> bytes:
    return msgpack.packb({"id": rep.id, "ok": rep.ok, "instance": rep.instance, "body": rep.body,
                          "error": rep.error}, use_bin_type=True)


def decode_reply(data: bytes) -> WireReply:
    d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return WireReply(id=int(d["id"]), ok=bool(d["ok"]), instance=str(d["instance"]), body=d.get("body"),
                 error=str(d.get("error") or ""))
