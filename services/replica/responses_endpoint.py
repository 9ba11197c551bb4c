"""`POST /v1/responses` on a replica: a Responses request, served as the chat request it translates to
(services.openai_api.responses_protocol) and answered as a `response` or its typed events
(services.replica.response_events)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from services.openai_api.body import read_json_body
from services.openai_api.errors import APIError
from services.openai_api.prompts import prepare_async
from services.openai_api.responses_protocol import parse_responses_request, responses_error, to_chat
from services.replica.response_events import ResponseEvents

if TYPE_CHECKING:
    from services.replica.openai_serving import OpenAIServing


class ResponsesEndpoint:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def responses(self, request: Request) -> Response:
        serving = self.serving
        serving.check_caller(request)
        body = await read_json_body(request, serving.config.max_body_bytes)
        req = parse_responses_request(body)
        lora_name = await serving.resolve_lora(request, req.model)
        chat, where = to_chat(req)
        try:
            prepared = await prepare_async(chat, serving.tokenizer, serving.config.max_model_len)
            return await serving.serve_prepared(
                request, prepared, "resp_", lambda acc: ResponseEvents(req, acc.request_id, acc.created, acc.usage),
                lora_name)
        except APIError as err:  # found before the response began: named as the Responses fields
            raise responses_error(err, where) from None
