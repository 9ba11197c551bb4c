"""`pagedserve serve`: router, scheduler and engine in one process, no Redis.

The same pieces as a cluster, wired in memory: the engine runs in-process, the replica's HTTP app
listens on a private loopback port, its publisher writes to an in-memory index, and the router on the
public port reads that index. One code path for a laptop and for Kubernetes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from services.commands.scheduler import replica_settings
from services.engine.config import EngineConfig
from services.internal_auth import InternalToken
from services.openai_api.server import make_server, run_servers
from services.ports import free_port
from services.registry.memory_index import MemoryIndex
from services.replica.service import build_replica
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.service import RouterConfig, RouterService
from services.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

REPLICA_ID = "local"


def run(args) -> int:
    try:
        keys = ApiKeys.from_sources(args.api_keys_file, args.api_keys)  # before minutes of model loading
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedserve serve: {exc}") from None
    from services.engine.model_runner import ModelRunner
    from services.scheduler.executor import InProcessExecutor

    runner = ModelRunner(EngineConfig.from_args(args))
    tokenizer = ModelTokenizer(runner.model_dir)
    # The replica's port is on loopback, but any local process could reach it there: only our router may.
    token = InternalToken.generate()
    settings = dataclasses.replace(replica_settings(args), internal_token=token)
    replica = build_replica(InProcessExecutor(runner), tokenizer, settings)
    index = MemoryIndex()
    internal_port = free_port()
    publisher = replica.publisher(index, REPLICA_ID, f"http://127.0.0.1:{internal_port}", args.max_num_seqs,
                                  heartbeat_interval=1.0)
    try:
        keys = ApiKeys.from_sources(args.api_keys_file, args.api_keys)
        router = RouterService(RouterConfig(cache_isolation=args.cache_isolation, max_body_bytes=args.max_body_bytes),
                               tokenizer, index, keys, internal_token=token)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pagedserve serve: {exc}") from None
    drain = getattr(args, "drain_timeout", 30.0)
    def render_metrics() -> tuple[bytes, str]:
        # One process, one scrape: the router's series and the replica's (queue, KV, latency).
        ours, content_type = router.metrics.render()
        return ours + replica.metrics.render()[0], content_type

    servers = [make_server(replica.app, "127.0.0.1", internal_port, drain, args.log_level),
               make_server(create_router_app(router, render_metrics), args.host, args.port, drain, args.log_level)]
    log.info("serving %s on http://%s:%d (OpenAI API at /v1)", replica.model_name, args.host, args.port)
    asyncio.run(run_servers(servers, [publisher.run(), replica.replica.supervise()], on_stop=[publisher.close]))
    return 0
