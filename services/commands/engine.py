"""`pagedserve engine`: the model weights and KV cache, serving the step protocol over TCP.

It listens on loopback by default (its scheduler sits beside it, in the same pod or machine); bound
anywhere else it refuses to start without an internal token, which every message must then carry.
With --tensor-parallel-size N it is rank 0 of a group of N ranks (services/engine/tp_launch.py).
"""

from __future__ import annotations

import logging
import signal

import zmq

from services.contracts.internal_auth import InternalToken
from services.engine.config import EngineConfig
from services.transport.engine_server import EngineServer

log = logging.getLogger(__name__)


# What a model that cannot be served raises while it loads: an architecture or config field that is not
# implemented, weight files missing, a split the model cannot take (all named in the message).
MODEL_LOAD_ERRORS = (ValueError, OSError, KeyError)


def start_engine(config: EngineConfig, command: str, **kwargs):
    """The engine's runner (rank 0 of its group), or exit with one line saying why the model cannot load."""
    from services.engine.tp_launch import start_runner

    try:
        return start_runner(config, **kwargs)
    except MODEL_LOAD_ERRORS as exc:
        raise SystemExit(f"pagedserve {command}: {exc}") from None


def run(args) -> int:
    # Beyond loopback a token is required: refused at parse time without one (flag_rules.engine_listener).
    token = InternalToken.from_sources(args.internal_token_file, args.internal_token)
    config = EngineConfig.from_args(args)  # checked at parse time (flag_rules.engine_config)
    # With --tensor-parallel-size N this process is rank 0: it starts the other ranks of this machine,
    # and exits when the group goes down (whoever supervises it restarts the group).
    runner = start_engine(config, "engine", exit_on_failure=True)
    try:
        server = EngineServer(runner, f"tcp://{args.host}:{args.port}", token)
    except zmq.ZMQError as exc:  # the port taken, or an address this machine does not have
        runner.close()
        raise SystemExit(f"pagedserve engine: cannot listen on {args.host}:{args.port}: {exc}") from None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    try:
        server.serve_forever()
    finally:
        runner.close()
    log.info("engine stopped after %d steps", server.steps_served)
    return 0
