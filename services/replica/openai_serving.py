"""The OpenAI endpoints of one replica, served over its backend (services.replica.replica_state.Replica).

Everything that can be wrong with a request is found before the response starts (a 4xx), and an
engine that fails before the first byte is a 503, which the router retries on another replica. A
client that goes away aborts its engine requests, which frees their KV blocks at once.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.contracts.internal_auth import HEADER, InternalToken
from services.model_files.lora_files import DIGEST_HEADER
from services.openai_api.body import parse_request, read_json_body
from services.openai_api.errors import APIError
from services.openai_api.prepared_wire import HEADER as PREPARED_HEADER
from services.openai_api.prepared_wire import from_wire
from services.openai_api.prompts import PreparedRequest, prepare_async
from services.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from services.openai_api.routes import check_model
from services.openai_api.streams import ClientGone, merge, until_disconnect
from services.openai_api.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize
from services.openai_api.tool_grammar import compile_constraint
from services.replica.accumulator import ResponseAccumulator
from services.replica.lora_demand import OnDemandLoader
from services.replica.metrics import RequestTimer, SchedulerMetrics
from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.async_scheduler import QueueFullError, QueueReservation
from services.scheduler.request_output import RequestOutput
from services.structured_output.compiler import GrammarCompiler

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


class ReplicaBackend(Protocol):
    healthy: bool

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_name: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def admit(self, num_seqs: int) -> QueueReservation:
        """Room in the replica's bounded queue for one request's sequences; raises QueueFullError."""
        ...


@dataclass
class ServingConfig:
    model_name: str
    max_model_len: int
    max_body_bytes: int = 4 * 1024 * 1024
    internal_token: InternalToken | None = None  # when set, only callers presenting it are served
    model_path: str = "pagedserve"  # how the engine runs the model (EngineInfo.model_path), shown by /v1/models


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def engine_error(acc: ResponseAccumulator) -> APIError:
    """An engine-wide failure is a 503 (another replica may serve it: the router retries); a failure
    this request caused alone is a 500 that nobody retries, so a poison request cannot spread."""
    if acc.error_kind == "request":
        return APIError(500, acc.error, code="request_failed")
    return APIError(503, f"the engine failed while serving this request: {acc.error}", code="engine_error")


class OpenAIServing:
    def __init__(self, backend: ReplicaBackend, tokenizer, config: ServingConfig,
                 metrics: SchedulerMetrics | None = None, grammars: GrammarCompiler | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        # The scheduler core's own compiler: compiling here, before admission, fills the cache it reads.
        self.grammars = grammars
        self.adapters: dict = {}  # LoRA adapter name -> LoraRef, as the core's registry holds them (read-only)
        self.on_demand: OnDemandLoader | None = None  # loads an adapter a router names with its digest

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, "cmpl-")

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, "chatcmpl-")

    async def tokenize(self, request: Request) -> Response:
        self.check_caller(request)
        req = parse_tokenize(await read_json_body(request, self.config.max_body_bytes))
        if req.model is not None:
            check_model(req.model, self.config.model_name)
        return JSONResponse(await tokenize(req, self.tokenizer, self.config.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        self.check_caller(request)
        req = parse_detokenize(await read_json_body(request, self.config.max_body_bytes))
        if req.model is not None:
            check_model(req.model, self.config.model_name)
        return JSONResponse(detokenize(req, self.tokenizer))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_caller(self, request: Request) -> None:
        """A replica behind routers serves only them: with API keys on the router, its port is no way around."""
        token = self.config.internal_token
        if token is not None and not token.accepts(request.headers.get(HEADER)):
            raise APIError(401, "this replica serves its routers only (missing or wrong internal token)",
                           code="invalid_internal_token")

    async def _serve(self, request: Request, model_cls, id_prefix: str) -> Response:
        self.check_caller(request)
        body = await read_json_body(request, self.config.max_body_bytes)
        if request.headers.get(PREPARED_HEADER) == "1":  # a router's prepared request: checked, not re-derived
            kind = "chat" if model_cls is ChatCompletionRequest else "completion"
            prepared = from_wire(body, self.tokenizer.vocab_size, self.config.max_model_len, kind)
            lora_name = await self.resolve_lora(request, prepared.model)
        else:
            req = parse_request(model_cls, body)
            lora_name = await self.resolve_lora(request, req.model)
            prepared = await prepare_async(req, self.tokenizer, self.config.max_model_len)
        return await self.serve_prepared(request, prepared, id_prefix, ChatFormat, lora_name)

    def resolve_model(self, requested: str) -> str | None:
        """None for the base model, the adapter's name for a loaded LoRA adapter; 404 otherwise."""
        if requested != self.config.model_name and requested in self.adapters:
            return requested
        check_model(requested, self.config.model_name)
        return None

    async def resolve_lora(self, request: Request, requested: str) -> str | None:
        """resolve_model, and for a router's request naming an adapter's digest: those weights, loaded here
        on demand if they are not yet (a retryable 503 when they cannot be)."""
        digest = request.headers.get(DIGEST_HEADER)
        if digest is None or requested == self.config.model_name or self.on_demand is None:
            return self.resolve_model(requested)
        await self.on_demand.ensure(requested, digest)
        return requested

    async def serve_prepared(self, request: Request, prepared: PreparedRequest, id_prefix: str,
                             make_format: Callable[[ResponseAccumulator], ResponseFormat],
                             lora_name: str | None = None) -> Response:
        """Run a validated request and answer it in the format `make_format` builds over its accumulator."""
        if self.grammars is not None and prepared.params.structured_outputs is not None:
            await compile_constraint(self.grammars, prepared.params.structured_outputs, prepared.tools)
        if not self.backend.healthy:
            raise APIError(503, "this replica's engine is unavailable", code="engine_unavailable")
        try:
            admission = self.backend.admit(prepared.params.num_sequences * len(prepared.prompts))
        except QueueFullError as exc:
            raise APIError(503, f"this replica's queue is full: {exc}", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        request_id = id_prefix + uuid.uuid4().hex
        acc = ResponseAccumulator(prepared.kind, request_id, prepared.model, prepared.params.n,
                                  [len(p) for p in prepared.prompts], self.token_text,
                                  prepared.params.logprobs is not None, prepared.include_usage, prepared.tools,
                                  prepared.echo)
        fmt = make_format(acc)
        run = _Run(self.backend, prepared, request_id, RequestTimer(self.metrics), admission, lora_name)
        try:
            if prepared.stream:
                return await self._stream(request, run, acc, fmt)  # the stream closes the run when it ends
            try:
                return await self._whole(request, run, acc, fmt)
            finally:
                run.close()
        except ClientGone:
            run.close()
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except InvalidRequestError as exc:
            run.close()
            raise APIError.from_invalid(exc) from None
        except BaseException:
            run.close()
            raise

    async def _whole(self, request: Request, run: _Run, acc: ResponseAccumulator, fmt: ResponseFormat) -> Response:
        async def collect() -> None:
            async for idx, out in run.outputs():
                fmt.absorb(acc.update(idx, out))
                run.timer.tokens_now(max(len(c.token_ids) for c in acc.choices))

        await until_disconnect(collect(), request)
        run.timer.finished()
        if acc.error:
            raise engine_error(acc)
        return JSONResponse(fmt.whole())

    async def _stream(self, request: Request, run: _Run, acc: ResponseAccumulator, fmt: ResponseFormat) -> Response:
        outputs = run.outputs()
        # Wait for the first output before sending headers: errors until then are a proper status code.
        first = await until_disconnect(anext(outputs), request)
        first_choices = acc.update(*first)
        if acc.error:
            raise engine_error(acc)

        async def events() -> AsyncIterator[str]:
            try:
                for event in fmt.opening() + fmt.chunks(first_choices):
                    yield event
                async for idx, out in outputs:
                    choices = acc.update(idx, out)
                    run.timer.tokens_now(max(len(c.token_ids) for c in acc.choices))
                    if acc.error:
                        log.warning("request %s failed mid-stream: %s", acc.request_id, acc.error)
                        for event in fmt.failed(engine_error(acc)):
                            yield event
                        return
                    for event in fmt.chunks(choices):
                        yield event
                run.timer.finished()
                for event in fmt.closing():
                    yield event
            finally:
                run.close()  # aborts what is unfinished (a client that left) and frees its queue room

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ResponseFormat(Protocol):
    """How a request's output is written: stream events (SSE text) and the whole response."""

    def opening(self) -> list[str]: ...

    def chunks(self, choices: list[dict]) -> list[str]: ...

    def absorb(self, choices: list[dict]) -> None:
        """What a non-streamed request does with an update's choices (the accumulator keeps the rest)."""
        ...

    def failed(self, err: APIError) -> list[str]: ...

    def closing(self) -> list[str]: ...

    def whole(self) -> dict: ...


class ChatFormat:
    """Completions and chat completions: `data:` chunks, usage, `[DONE]`."""

    def __init__(self, acc: ResponseAccumulator):
        self.acc = acc

    def opening(self) -> list[str]:
        return []

    def chunks(self, choices: list[dict]) -> list[str]:
        return [sse(c) for c in self.acc.chunks(choices)]

    def absorb(self, choices: list[dict]) -> None:
        pass

    def failed(self, err: APIError) -> list[str]:
        return [sse(err.body())]

    def closing(self) -> list[str]:
        return ([sse(self.acc.usage_chunk())] if self.acc.include_usage else []) + ["data: [DONE]\n\n"]

    def whole(self) -> dict:
        return self.acc.response()


class _Run:
    """The engine requests behind one HTTP request (one per prompt)."""

    def __init__(self, backend: ReplicaBackend, prepared: PreparedRequest, request_id: str, timer: RequestTimer,
                 admission: QueueReservation, lora_name: str | None = None):
        self.backend = backend
        self.lora_name = lora_name
        self.prepared = prepared
        self.timer = timer
        self.admission = admission
        self.ids = [request_id] if len(prepared.prompts) == 1 else [
            f"{request_id}-{i}" for i in range(len(prepared.prompts))]
        self.done: set[str] = set()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        extra = () if self.lora_name is None else (self.lora_name,)
        streams = [self.backend.generate(rid, p, self.prepared.params, *extra)
                   for rid, p in zip(self.ids, self.prepared.prompts, strict=True)]
        async for idx, out in merge(streams):
            if out.finished:
                self.done.add(self.ids[idx])
            yield idx, out

    def close(self) -> None:
        """End of the HTTP request: abort the engine requests still running, give back the queue room."""
        for rid in self.ids:
            if rid not in self.done:
                self.backend.abort(rid)
                self.done.add(rid)
        self.admission.release()

