"""`pagedserve router`: the public OpenAI endpoint, routing over the Redis registry to every model in it."""

from __future__ import annotations

import asyncio
import logging

from services.contracts.internal_auth import InternalToken
from services.model_files.model_source import resolve_tokenizer
from services.model_files.tokenizer import ModelTokenizer
from services.openai_api.server import make_server, run_servers
from services.registry.redis_sink import connect, redacted
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.redis_index import RedisIndex
from services.router.service import RouterConfig, RouterService

log = logging.getLogger(__name__)


def router_config(args) -> RouterConfig:
    return RouterConfig(policy=args.policy, cache_isolation=args.cache_isolation, max_queue=args.max_queue,
                        max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                        cold_start_timeout=args.cold_start_timeout)


def run(args) -> int:
    # --redis-url given, and --k8s-service with --discovery kubernetes: flag_rules.router_registry.
    replica_filter = None
    if args.discovery == "kubernetes":
        from services.router.k8s_discovery import EndpointSliceDiscovery

        replica_filter = EndpointSliceDiscovery(args.k8s_service, args.k8s_namespace)
        replica_filter.start()
    try:
        keys = ApiKeys.from_sources(args.api_keys_file, args.api_keys)
        token = InternalToken.from_sources(args.internal_token_file, args.internal_token)
    except (ValueError, OSError) as exc:  # keys or token configured but unusable: never start open
        raise SystemExit(f"pagedserve router: {exc}") from None
    if token is None:
        log.warning("no internal token: schedulers cannot tell this router from any other caller, and registry "
                    "records are not verified (set --internal-token-file in production)")
    if keys.enabled:
        log.info("API keys required (%s)", "file and/or env" if args.api_keys_file else "env/flag")
    # Each model's tokenizer and chat template come from the registry (its replicas publish them); a
    # --model given here is used for the model whose tokenizer it matches. Never weights.
    tokenizer = ModelTokenizer(resolve_tokenizer(args.model)) if args.model else None
    try:
        service = RouterService(router_config(args), tokenizer, RedisIndex(connect(args.redis_url), signer=token),
                                keys, replica_filter, token)
    except ValueError as exc:  # a configuration that cannot be served safely: say so and stop
        raise SystemExit(f"pagedserve router: {exc}") from None
    server = make_server(create_router_app(service), args.host, args.port, args.drain_timeout, args.log_level)
    log.info("router on %s:%d, policy %s, registry %s%s", args.host, args.port, args.policy, redacted(args.redis_url),
             f", holding requests up to {args.cold_start_timeout:g}s while no replica is ready"
             if args.cold_start_timeout else "")
    asyncio.run(run_servers([server]))
    return 0
