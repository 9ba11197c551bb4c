"""`pagedserve serve`: router, scheduler and engine in one process, no Redis.

The same pieces as a cluster, wired in memory: the engine runs in-process, the replica's HTTP app
listens on a private loopback port, its publisher writes to an in-memory index, and the router on the
public port reads that index. One code path for a laptop and for Kubernetes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import SimpleNamespace

from services.commands.router import build_router
from services.commands.scheduler import replica_settings
from services.openai_api.server import make_server, run_servers
from services.registry.memory_index import MemoryIndex
from services.replica.service import build_replica
from services.router.app import create_router_app
from services.settings import parse_bytes

log = logging.getLogger(__name__)

REPLICA_ID = "local"


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> int:
    from services.engine.model_runner import ModelRunner
    from services.scheduler.executor import InProcessExecutor

    runner = ModelRunner(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                         num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
                         max_model_len=args.max_model_len)
    replica = build_replica(InProcessExecutor(runner), runner.model_dir, replica_settings(args))
    index = MemoryIndex()
    internal_port = _free_loopback_port()
    publisher = replica.publisher(index, REPLICA_ID, f"http://127.0.0.1:{internal_port}", args.max_num_seqs,
                                  heartbeat_interval=1.0)
    router_args = SimpleNamespace(**{**vars(args), "served_model_name": replica.model_name, "policy": "prefix",
                                     "max_queue": 256, "request_timeout": 600.0})
    router = build_router(router_args, index)
    drain = getattr(args, "drain_timeout", 30.0)
    def render_metrics() -> tuple[bytes, str]:
        # One process, one scrape: the router's series and the replica's (queue, KV, latency).
        ours, content_type = router.metrics.render()
        return ours + replica.metrics.render()[0], content_type

    servers = [make_server(replica.app, "127.0.0.1", internal_port, drain, args.log_level),
               make_server(create_router_app(router, render_metrics), args.host, args.port, drain, args.log_level)]
    log.info("serving %s on http://%s:%d (OpenAI API at /v1)", replica.model_name, args.host, args.port)
    asyncio.run(run_servers(servers, [publisher.run()], on_stop=[publisher.close]))
    return 0
