"""`pagedserve probe engine`: the engine container's own health check, for Kubernetes exec probes.

A TCP connect says nothing about a hung engine: the kernel (and libzmq) accept connections while Python
or CUDA is stuck. This sends the step protocol's `health` request and waits for the engine loop's
answer, so it fails when the loop is frozen, deadlocked or busy past the timeout, which is what the
liveness probe must see to restart the engine (and not its scheduler).
"""

from __future__ import annotations

import sys
import time

import zmq

from services.contracts.internal_auth import InternalToken
from services.transport.wire import WireRequest, decode_reply, encode_request


def engine_health(url: str, timeout: float, auth: str | None = None) -> tuple[bool, str]:
    """One `health` round trip to the engine at `url` (with the internal token, when the engine requires
    one): (answered healthy, what happened)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        # Queued until the connection is up; an engine that is not listening never answers.
        sock.send(encode_request(WireRequest(id=1, op="health", auth=auth)))
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if not sock.poll(int(remaining * 1000) + 1):
                break
            reply = decode_reply(sock.recv())
            if reply.id != 1:
                continue
            if not reply.ok:
                return False, f"engine at {url} answered health with an error: {reply.error}"
            return True, f"engine at {url} healthy (instance {reply.instance[:8]}, {reply.body})"
        return False, f"engine at {url} did not answer health within {timeout:g}s"
    finally:
        sock.close(0)


def run(args) -> int:
    token = InternalToken.from_sources(args.internal_token_file, None)
    ok, message = engine_health(args.engine, args.timeout, token.value if token else None)
    print(message, file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1
