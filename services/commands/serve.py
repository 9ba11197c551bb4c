"""`pagedserve serve`: the whole system from one command, no Redis.

The same pieces as a cluster: the engine runs in a child process of its own (as in `up` and in
Kubernetes, and as vLLM's EngineCore does), so forward passes never share an interpreter, or its GIL,
with HTTP, streaming and scheduling; the replica's HTTP app listens on a private loopback port, its
publisher writes to an in-memory index, and the router on the public port reads that index. An engine
that dies is restarted and the replica rejoins by itself. `--in-process-engine` keeps everything in one
process (debugging, or a machine where a child process cannot be started).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time

from services.commands.ports import free_port
from services.commands.processes import ENGINE_FLAGS, Child, flags
from services.commands.scheduler import REPLICA_START_ERRORS, replica_settings
from services.contracts.internal_auth import InternalToken
from services.model_files.tokenizer import ModelTokenizer
from services.openai_api.server import make_server, run_servers
from services.registry.memory_index import MemoryIndex
from services.replica.service import build_replica
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.service import RouterConfig, RouterService

log = logging.getLogger(__name__)

REPLICA_ID = "local"
ENGINE_START_TIMEOUT = 3600.0  # a first start converts the model and may compile kernels
ENGINE_STEP_TIMEOUT = 120.0


def _in_process_engine(args):
    from services.commands.engine import start_engine
    from services.engine.config import EngineConfig
    from services.scheduler.executor import InProcessExecutor

    runner = start_engine(EngineConfig.from_args(args), "serve")
    return InProcessExecutor(runner), runner.model_dir


def _engine_child(args, token: InternalToken):
    """Start `pagedserve engine` on a loopback port and wait for its handshake, watching that it lives."""
    from services.model_files.model_source import resolve_tokenizer
    from services.transport.remote_executor import RemoteExecutor

    port = free_port()
    child = Child("engine", [sys.executable, "-m", "services.commands.cli", "engine", "--host", "127.0.0.1", "--port",
                             str(port), *flags(args, ENGINE_FLAGS)], token.env())
    child.start()
    executor = RemoteExecutor(f"tcp://127.0.0.1:{port}", timeout=ENGINE_STEP_TIMEOUT, token=token)
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while True:
        if not child.alive:
            raise SystemExit(f"pagedserve serve: the engine exited with code {child.proc.returncode} during start-up")
        try:
            executor.wait_ready(2.0)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise SystemExit("pagedserve serve: the engine did not answer within "
                                 f"{ENGINE_START_TIMEOUT:.0f}s") from None
    return child, executor, resolve_tokenizer(args.model)  # the engine converted it: tokenizer files exist


async def _restart_dead(child: Child) -> None:
    """As `up` does: an engine that died comes back, and the replica's supervision re-adopts it."""
    while True:
        await asyncio.sleep(0.5)
        if child.proc is not None and child.proc.poll() is not None:
            log.warning("the engine exited with code %s; restarting it", child.proc.returncode)
            child.restarts += 1
            child.start()


def run(args) -> int:
    try:  # checked at parse time too (flag_rules.secrets, with the admin key), before minutes of model loading
        keys = ApiKeys.from_sources(args.api_keys_file, args.api_keys)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedserve serve: {exc}") from None
    # The replica's port is on loopback, but any local process could reach it there: only our router may.
    token = InternalToken.generate()
    child = None
    if args.in_process_engine:
        executor, model_dir = _in_process_engine(args)
    else:
        child, executor, model_dir = _engine_child(args, token)
    tokenizer = ModelTokenizer(model_dir)
    settings = dataclasses.replace(replica_settings(args), internal_token=token)
    try:
        replica = build_replica(executor, tokenizer, settings)
    except REPLICA_START_ERRORS as exc:
        executor.close()
        if child is not None:
            child.signal(15)
            child.wait(30)
        raise SystemExit(f"pagedserve serve: {exc}") from None
    index = MemoryIndex()
    internal_port = free_port()
    publisher = replica.publisher(index, REPLICA_ID, f"http://127.0.0.1:{internal_port}", args.max_num_seqs,
                                  heartbeat_interval=1.0)
    try:
        router = RouterService(RouterConfig(cache_isolation=args.cache_isolation, max_body_bytes=args.max_body_bytes),
                               tokenizer, index, keys, internal_token=token)
    except ValueError as exc:
        raise SystemExit(f"pagedserve serve: {exc}") from None
    drain = getattr(args, "drain_timeout", 30.0)

    def render_metrics() -> tuple[bytes, str]:
        # One process, one scrape: the router's series and the replica's (queue, KV, latency).
        ours, content_type = router.metrics.render()
        return ours + replica.metrics.render()[0], content_type

    public = create_router_app(router, render_metrics)
    if replica.lora_admin is not None:  # one process: the admin endpoints on the public port too
        public.add_api_route("/v1/load_lora_adapter", replica.lora_admin.load, methods=["POST"])
        public.add_api_route("/v1/unload_lora_adapter", replica.lora_admin.unload, methods=["POST"])
    servers = [make_server(replica.app, "127.0.0.1", internal_port, drain, args.log_level),
               make_server(public, args.host, args.port, drain, args.log_level)]
    background = [publisher.run(), replica.replica.supervise()]
    if child is not None:
        background.append(_restart_dead(child))
    log.info("serving %s on http://%s:%d (OpenAI API at /v1)", replica.model_name, args.host, args.port)
    try:
        asyncio.run(run_servers(servers, background, on_stop=[publisher.close]))
    finally:
        replica.replica.loop.shutdown()
        executor.close()
        if child is not None:  # after the servers drained: in-flight requests needed it until then
            child.signal(15)
            child.wait(30)
    return 0
