"""`pagedserve router`: the public OpenAI endpoint, routing over the Redis registry."""

from __future__ import annotations

import asyncio
import json
import logging

from services.block_hash import model_hash_seed
from services.model_source import DEFAULT_MODEL_NAME, resolve_model
from services.openai_api.server import make_server, run_servers
from services.registry.redis_sink import connect, redacted
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.prompt_tokenizer import PromptTokenizer
from services.router.redis_index import RedisIndex
from services.router.service import RouterConfig, RouterService

log = logging.getLogger(__name__)


def default_model_name(model_arg: str | None, model_dir) -> str:
    """The name an engine reports for this model argument (its model id), so defaults agree."""
    if model_arg is None or str(model_arg) in ("", "default", DEFAULT_MODEL_NAME):
        return DEFAULT_MODEL_NAME
    return model_dir.name


def router_config(args, model_dir) -> RouterConfig:
    engine_model_id = default_model_name(args.model, model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    return RouterConfig(
        model_name=args.served_model_name or engine_model_id,
        max_model_len=int(hf_config.get("max_position_embeddings", 2048)),
        block_size=args.block_size, hash_seed=model_hash_seed(engine_model_id, args.block_size),
        policy=args.policy, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout)


def build_router(args, index, replica_filter=None) -> RouterService:
    model_dir = resolve_model(args.model)
    keys = ApiKeys.from_sources(args.api_keys_file, args.api_keys)
    if keys.enabled:
        log.info("API keys required (%s)", "file and/or env" if args.api_keys_file else "env/flag")
    return RouterService(router_config(args, model_dir), PromptTokenizer(model_dir), index, keys, replica_filter)


def run(args) -> int:
    if not args.redis_url:
        raise SystemExit("pagedserve router needs --redis-url (or PAGEDSERVE_REDIS_URL): the registry lives there")
    replica_filter = None
    if args.discovery == "kubernetes":
        from services.router.k8s_discovery import EndpointSliceDiscovery

        replica_filter = EndpointSliceDiscovery(args.k8s_service, args.k8s_namespace)
        replica_filter.start()
    service = build_router(args, RedisIndex(connect(args.redis_url)), replica_filter)
    server = make_server(create_router_app(service), args.host, args.port, args.drain_timeout, args.log_level)
    log.info("router on %s:%d, policy %s, registry %s", args.host, args.port, args.policy, redacted(args.redis_url))
    asyncio.run(run_servers([server]))
    return 0
