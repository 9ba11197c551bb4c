"""`pagedserve scheduler`: continuous batching for one remote engine, behind the OpenAI HTTP API.

HTTP is up at once: /live answers 200 while the process's event loop runs (the liveness probe), and
/health 503 until the engine's handshake (it may still be loading weights) and whenever the engine
fails (the readiness probe). With --redis-url the replica registers itself,
heartbeats its load and publishes its cached blocks for routers.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from services.contracts.internal_auth import InternalToken
from services.model_files.model_source import resolve_tokenizer
from services.model_files.tokenizer import ModelTokenizer
from services.openai_api.server import LivenessApp, StartingApp, make_server, run_servers
from services.replica.service import ReplicaSettings, build_replica
from services.transport.remote_executor import EngineOpError, RemoteExecutor

log = logging.getLogger(__name__)

ENGINE_STARTUP_TIMEOUT = 3600.0  # first start may convert a GGUF model; the startup probe bounds it anyway
# What building a replica on its engine raises for a configuration that engine cannot serve: an adapter it
# refuses (no LoRA slots, a rank over its --max-lora-rank, shapes of another model), named in the message.
REPLICA_START_ERRORS = (ValueError, EngineOpError)


def default_advertise_url(host: str, port: int) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return f"http://{host}:{port}"
    try:
        return f"http://{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return f"http://127.0.0.1:{port}"


def replica_settings(args) -> ReplicaSettings:
    return ReplicaSettings(served_model_name=args.served_model_name, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           enable_prefix_caching=args.enable_prefix_caching, max_model_len=args.max_model_len,
                           max_body_bytes=args.max_body_bytes, max_waiting=args.max_waiting,
                           lora_modules=list(getattr(args, "lora_modules", None) or []),
                           lora_dir=getattr(args, "lora_dir", None),
                           lora_admin_key=getattr(args, "lora_admin_key", None),
                           speculative_config=getattr(args, "speculative_config", None),
                           internal_token=InternalToken.from_sources(getattr(args, "internal_token_file", None),
                                                                     getattr(args, "internal_token", None)))


def run(args) -> int:
    asyncio.run(_main(args))
    return 0


async def _main(args) -> None:
    # Tokenizer and config only: the engine owns the weights (and any conversion of them).
    tokenizer = ModelTokenizer(await asyncio.to_thread(resolve_tokenizer, args.model))
    settings = replica_settings(args)
    executor = RemoteExecutor(args.engine, timeout=args.engine_timeout, token=settings.internal_token)
    starting = StartingApp("the engine is not ready yet")
    server = make_server(LivenessApp(starting), args.host, args.port, args.drain_timeout, args.log_level,
                         lifespan="off")
    publishers: list = []
    refused: list[str] = []

    async def leave_registry() -> None:
        for pub in publishers:
            await pub.close()

    async def start_replica() -> None:
        log.info("waiting for the engine at %s", args.engine)
        await asyncio.to_thread(executor.wait_ready, ENGINE_STARTUP_TIMEOUT)
        try:
            service = await asyncio.to_thread(build_replica, executor, tokenizer, settings)
        except REPLICA_START_ERRORS as exc:  # no use retrying: stop, and exit with the reason
            refused.append(str(exc))
            server.should_exit = True
            return
        starting.target = service.app
        log.info("replica ready: model %s, %d KV blocks", service.model_name, service.replica.core.info.num_kv_blocks)
        tasks = [service.replica.supervise()]
        if args.redis_url:
            from services.registry.redis_sink import RedisSink, connect, redacted

            replica_id = args.replica_id or f"{socket.gethostname()}:{args.port}"
            url = args.advertise_url or default_advertise_url(args.host, args.port)
            sink = RedisSink(connect(args.redis_url), signer=settings.internal_token)
            pub = service.publisher(sink, replica_id, url, args.max_num_seqs, args.heartbeat_interval)
            publishers.append(pub)
            tasks.append(pub.run())
            log.info("registered as %s at %s in %s", replica_id, url, redacted(args.redis_url))
        await asyncio.gather(*tasks)

    try:
        await run_servers([server], [start_replica()], on_stop=[leave_registry])
    finally:
        executor.close()
    if refused:
        raise SystemExit(f"pagedserve scheduler: the engine at {args.engine} cannot serve this replica: {refused[0]}")
