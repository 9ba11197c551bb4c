"""`pagedserve engine`: the model weights and KV cache, serving the step protocol over TCP.

It listens on loopback by default (its scheduler sits beside it, in the same pod or machine); bound
anywhere else it refuses to start without an internal token, which every message must then carry.
With --tensor-parallel-size N it is rank 0 of a group of N ranks (services/engine/tp_launch.py).
"""

from __future__ import annotations

import logging
import signal

from services.contracts.internal_auth import InternalToken
from services.engine.config import EngineConfig
from services.transport.engine_server import EngineServer

log = logging.getLogger(__name__)


def run(args) -> int:
    # Beyond loopback a token is required: refused at parse time without one (flag_rules.engine_listener).
    token = InternalToken.from_sources(args.internal_token_file, args.internal_token)
    from services.engine.tp_launch import start_runner
    from services.engine.tp_shard import TensorParallelConfigError

    try:
        config = EngineConfig.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pagedserve engine: {exc}") from None
    try:
        # With --tensor-parallel-size N this process is rank 0: it starts the other ranks of this
        # machine, and exits when the group goes down (whoever supervises it restarts the group).
        runner = start_runner(config, exit_on_failure=True)
    except TensorParallelConfigError as exc:
        raise SystemExit(f"pagedserve engine: {exc}") from None
    server = EngineServer(runner, f"tcp://{args.host}:{args.port}", token)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    try:
        server.serve_forever()
    finally:
        runner.close()
    log.info("engine stopped after %d steps", server.steps_served)
    return 0
