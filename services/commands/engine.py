"""`pagedserve engine`: the model weights and KV cache, serving the step protocol over TCP.

It listens on loopback by default (its scheduler sits beside it, in the same pod or machine); bound
anywhere else it refuses to start without an internal token, which every message must then carry.
"""

from __future__ import annotations

import ipaddress
import logging
import signal

from services.engine.config import EngineConfig
from services.internal_auth import InternalToken
from services.transport.engine_server import EngineServer

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    token = InternalToken.from_sources(args.internal_token_file, args.internal_token)
    if token is None and not is_loopback(args.host):
        raise SystemExit(f"pagedserve engine: --host {args.host} would let anyone who reaches the port run steps "
                         "and reset the KV cache; give it --internal-token-file (or listen on 127.0.0.1)")
    from services.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig.from_args(args))
    server = EngineServer(runner, f"tcp://{args.host}:{args.port}", token)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.serve_forever()
    log.info("engine stopped after %d steps", server.steps_served)
    return 0
