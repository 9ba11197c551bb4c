"""One routed request, end to end: authenticate, validate, tokenize once, hash, pick, forward.

The router validates with the scheduler's own rules (services.openai_api) so bad input never costs a
replica anything, and it forwards the token ids it computed, so the scheduler does not tokenize again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.contracts.block_hash import adapter_seed, hash_blocks, salted_seed
from services.contracts.internal_auth import InternalToken
from services.model_files.lora_files import DIGEST_HEADER
from services.openai_api.body import parse_request, read_json_body
from services.openai_api.errors import APIError
from services.openai_api.prepared_wire import HEADER as PREPARED_HEADER
from services.openai_api.prepared_wire import to_wire
from services.openai_api.prompts import prepare_async
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from services.openai_api.responses_protocol import (
    ResponsesRequest,
    parse_responses_request,
    responses_error,
    to_chat,
)
from services.openai_api.tokenize import detokenize as detokenize_request
from services.openai_api.tokenize import parse_detokenize, parse_tokenize
from services.openai_api.tokenize import tokenize as tokenize_request
from services.openai_api.tool_grammar import compile_constraint
from services.registry.model import PrefixIndex
from services.router.auth import ApiKeys
from services.router.metrics import RouterMetrics
from services.router.policies import RANKED, RouteRequest, make_policy, match_ratio, shortlists, useful_blocks
from services.router.proxy import Proxy
from services.router.replicas import NoReplicasError, ReplicaFilter, ReplicaView, ServedModel, saturated
from services.router.request_time import RequestTimes
from services.router.tokenizers import ModelText, ModelTokenizers
from services.router.waiting_queue import ModelQueues

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"


@dataclass
class RouterConfig:
    """How this router routes. What it routes to (model names, block size, hash seed, context length,
    tokenizer and chat template, adapters) it learns from the replicas' registry records."""

    policy: str = "prefix"
    cache_isolation: str = "shared"  # or "per-key": each API key gets its own prefix cache (a salt)
    max_queue: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout: float = 600.0
    cold_start_timeout: float = 0.0  # hold requests this long while no replica is ready (scale from zero)


def key_salt(api_key: bytes, client_salt: str | None) -> str:
    """A cache salt per API key that does not reveal the key (it travels to schedulers in the body)."""
    tag = hashlib.sha256(b"pagedserve-cache-salt:" + api_key).hexdigest()[:32]
    return f"key:{tag}" if not client_salt else f"key:{tag}/{client_salt}"


class RouterService:
    def __init__(self, config: RouterConfig, tokenizer, index: PrefixIndex, api_keys: ApiKeys,
                 replica_filter: ReplicaFilter | None = None, internal_token: InternalToken | None = None):
        """`tokenizer`: one this process has already (or None); every other model's comes from the registry."""
        if config.cache_isolation == "per-key" and not api_keys.enabled:
            raise ValueError("--cache-isolation per-key needs API keys (--api-keys-file): keys are the tenants")
        self.config = config
        self.tokenizers = ModelTokenizers(index, tokenizer)
        self.keys = api_keys
        self.metrics = RouterMetrics()
        self.policy = make_policy(config.policy)
        self.view = ReplicaView(index, self.metrics, replica_filter)
        self.admission = ModelQueues(config.max_queue, self.metrics, config.cold_start_timeout)
        self.proxy = Proxy(config.request_timeout, self.metrics, self._started, self._done, internal_token)
        self._background: set[asyncio.Task] = set()
        self.request_times = RequestTimes()
        self._model_of: dict[str, str] = {}  # replica id -> its model, for the request clock

    async def completions(self, request: Request) -> Response:
        return await self._counted(self._route(request, CompletionRequest, "/v1/completions"))

    async def chat(self, request: Request) -> Response:
        return await self._counted(self._route(request, ChatCompletionRequest, "/v1/chat/completions"))

    async def responses(self, request: Request) -> Response:
        return await self._counted(self._route(request, ResponsesRequest, "/v1/responses"))
    async def tokenize(self, request: Request) -> Response:
        return await self._counted(self._tokenize(request, tokenize=True))

    async def detokenize(self, request: Request) -> Response:
        return await self._counted(self._tokenize(request, tokenize=False))

    async def _tokenize(self, request: Request, tokenize: bool) -> Response:
        """Answered here with the routing tokenizer (the replicas' own): no replica is involved."""
        arrived = time.monotonic()
        self.keys.check(request.headers.get("authorization"))
        body = await read_json_body(request, self.config.max_body_bytes)
        req = parse_tokenize(body) if tokenize else parse_detokenize(body)
        model = req.model
        if model is None:  # optional, as in vLLM: fine while one model is served
            served = [m[0] for m in await self.view.models()]
            if len(served) > 1:
                raise APIError(400, f"model: required when several models are served ({', '.join(served)})",
                               "model")
            model = served[0] if served else ""
        served = await self.admission.hold.admit(lambda: self.view.resolve(model), self.config.request_timeout,
                                                 arrived)
        text = await self.tokenizers.get(served.identity.model, served.tokenizer_digest)
        self.metrics.requests.labels("200").inc()
        if tokenize:
            return JSONResponse(await tokenize_request(req, text.tokenizer, served.max_model_len))
        return JSONResponse(detokenize_request(req, text.tokenizer))

    async def _counted(self, handling) -> Response:
        """Count what the router answers itself; forwarded answers are counted by the proxy."""
        try:
            return await handling
        except APIError as exc:
            self.metrics.requests.labels(str(exc.status)).inc()
            raise
        except Exception:
            self.metrics.requests.labels("500").inc()
            raise

    async def _route(self, request: Request, model_cls, path: str) -> Response:
        arrived = time.monotonic()
        key = self.keys.check(request.headers.get("authorization"))
        body = await read_json_body(request, self.config.max_body_bytes)
        req = parse_responses_request(body) if model_cls is ResponsesRequest else parse_request(model_cls, body)
        if self.config.cache_isolation == "per-key" and key is not None:
            # The key's own salt, before any the client chose: one key can never match another's blocks.
            req.cache_salt = body["cache_salt"] = key_salt(key, req.cache_salt)
        # With no replica registered yet (scale from zero) the model's identity is unknown: hold here.
        served = await self.admission.hold.admit(lambda: self.view.resolve(req.model), self.config.request_timeout,
                                                 arrived)
        identity, max_model_len = served.identity, served.max_model_len
        text = await self.tokenizers.get(identity.model, served.tokenizer_digest)
        if isinstance(req, ResponsesRequest):  # validated and routed as the chat request it becomes
            chat, where = to_chat(req)
            try:
                prepared = await self._prepare(text, chat, max_model_len)
            except APIError as err:
                raise responses_error(err, where) from None
        else:
            prepared = await self._prepare(text, req, max_model_len)
        ids = prepared.prompts[0]
        if isinstance(req, ResponsesRequest):
            # The replica answers in the Responses shape, which it builds from the request itself.
            body["prompt_token_ids"] = ids
            payload, extra = json.dumps(body).encode(), {}
        else:  # what the router prepared, so the replica does not derive it again (services.openai_api.prepared_wire)
            payload, extra = to_wire(prepared), {PREPARED_HEADER: "1"}
        # An adapter's blocks are chained under its own root (its files' digest), as its replicas file them.
        seed = adapter_seed(identity.hash_seed, served.adapter_digest) if served.adapter else identity.hash_seed
        root = salted_seed(seed, req.cache_salt)
        route = RouteRequest(hash_blocks(ids, identity.block_size, root), len(ids),
                             identity.block_size, request.headers.get(SESSION_HEADER), served.adapter,
                             served.adapter_digest, self.request_times.mean_seconds(identity.model))
        # The model's own queue: a burst for another model never fills it.
        ranked = await self.admission.of(identity.model).admit(lambda: self._pick(served, route),
                                                               self.config.request_timeout, arrived)
        chosen = ranked[0]
        self.metrics.decisions.labels(self.policy.name, chosen.info.replica_id).inc()
        self.metrics.prefix_match.observe(min(1.0, match_ratio(chosen, route)))
        if chosen.matched_blocks < len(route.block_hashes):
            self._spawn(self.view.claim(chosen.info.replica_id, route.block_hashes, chosen.matched_blocks))
        # The adapter's digest goes along: a replica where it is not resident loads those weights (and no
        # others) from its adapter directory, or says it cannot and the proxy tries the next.
        headers = {DIGEST_HEADER: served.adapter_digest, **extra} if served.adapter else extra
        return await self.proxy.forward(request, ranked, path, payload, headers or None, served.adapter)

    async def _prepare(self, text: ModelText, req, max_model_len: int):
        """Prompt and sampling parameters, with the request's constraint compiled (a 400 if it cannot be)."""
        prepared = await prepare_async(req, text.tokenizer, max_model_len)
        if prepared.params.structured_outputs is not None:
            # Compiled here (on the compiler's threads, cached), so one that never can is a 400 before it costs
            # a replica anything. The replica builds its own matcher from the same constraint (an llguidance
            # matcher cannot cross a process), from its own cache after the first time.
            await compile_constraint(text.grammars, prepared.params.structured_outputs, prepared.tools)
        return prepared

    async def _pick(self, served: ServedModel, route: RouteRequest) -> list | None:
        identity = served.identity
        if shortlists(self.policy, route):
            open_, any_usable = await self.view.shortlist(route.block_hashes, useful_blocks(route), identity, RANKED)
        else:
            snapshot = await self.view.snapshot(route.block_hashes, useful_blocks(route))
            replicas = [r for r in snapshot if r.info.identity == identity]
            any_usable, open_ = bool(replicas), [r for r in replicas if not saturated(r)]
        if not any_usable:
            raise NoReplicasError(f"no healthy replica of {served.adapter or identity.model} is registered")
        if not open_:
            return None
        ranked = self.policy.rank(open_, route)
        for r in ranked:  # the proxy goes to these only
            self._model_of[r.info.replica_id] = identity.model
        return ranked

    def _started(self, replica_id: str) -> None:
        self.view.inflight[replica_id] += 1
        self.request_times.started(self._model_of.get(replica_id, ""))

    def _done(self, replica_id: str) -> None:
        self.view.inflight[replica_id] -= 1
        self.request_times.done(self._model_of.get(replica_id, ""))
        self.admission.released()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await self.proxy.close()
        self.tokenizers.close()
        close_index = getattr(self.view.index, "close", None)
        if close_index is not None:
            await close_index()
