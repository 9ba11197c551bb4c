"""`pagedserve engine`: the model weights and KV cache, serving the step protocol over TCP."""

from __future__ import annotations

import logging
import signal

from services.engine.config import EngineConfig
from services.transport.engine_server import EngineServer

log = logging.getLogger(__name__)


def run(args) -> int:
    from services.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig.from_args(args))
    server = EngineServer(runner, f"tcp://{args.host}:{args.port}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.serve_forever()
    log.info("engine stopped after %d steps", server.steps_served)
    return 0
