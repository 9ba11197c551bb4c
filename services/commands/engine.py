"""`pagedserve engine`: the model weights and KV cache, serving the step protocol over TCP."""

from __future__ import annotations

import logging
import signal

from services.settings import parse_bytes
from services.transport.engine_server import EngineServer

log = logging.getLogger(__name__)


def run(args) -> int:
    from services.engine.model_runner import ModelRunner

    runner = ModelRunner(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                         num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
                         max_model_len=args.max_model_len)
    server = EngineServer(runner, f"tcp://{args.host}:{args.port}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.serve_forever()
    log.info("engine stopped after %d steps", server.steps_served)
    return 0
