"""Loading and unloading LoRA adapters at run time: vLLM's `POST /v1/load_lora_adapter` {lora_name,
lora_path} and `POST /v1/unload_lora_adapter` {lora_name}, behind an admin key.

The admin key is its own secret (`--lora-admin-key`): an API key lets a client use the models, never
change them, and the internal token belongs to the routers. Without an admin key the endpoints answer
403. A path is served only from inside `--lora-dir` once every symlink is resolved, only as
safetensors (never pickle), within the rank and size limits; what is wrong is a 400 naming it, checked
here before the engine reads anything (services/model_files/lora_files.py) and again by the engine against the
model's shapes. The load itself runs on the step loop between two steps: requests in flight go on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from services.model_files.lora_files import AdapterError, read_adapter
from services.openai_api.body import read_json_body
from services.openai_api.errors import APIError

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 256
_LOAD_FIELDS = {"lora_name", "lora_path", "load_inplace"}
_UNLOAD_FIELDS = {"lora_name", "lora_int_id"}


class LoraAdmin:
    """`replica`: services.replica.replica_state.Replica; `base_model`: the served name an adapter may not take;
    `on_change`: called after every load or unload (the registry record names the resident adapters)."""

    def __init__(self, replica, base_model: str, admin_key: str | None, lora_dir: str | None,
                 on_change: Callable[[], None] = lambda: None, max_body_bytes: int = 1 << 16):
        self.replica = replica
        self.base_model = base_model
        self._key = admin_key.encode() if admin_key else None
        self.lora_dir = lora_dir
        self.on_change = on_change
        self.max_body_bytes = max_body_bytes
        # Seconds the last successful load took (read, hash, engine load): routers weigh it as the cost of
        # sending an adapter's request where the adapter is not resident. 0.0 until a load is measured.
        self.last_load_seconds = 0.0

    def _check_admin(self, request: Request) -> None:
        if self._key is None:
            raise APIError(403, "loading LoRA adapters at run time is off: start with --lora-admin-key",
                           code="lora_admin_disabled")
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        if not hmac.compare_digest(given, self._key):
            raise APIError(401, "missing or wrong LoRA admin key (Authorization: Bearer <admin key>)",
                           code="invalid_admin_key")

    async def _body(self, request: Request, allowed: set[str]) -> dict:
        self._check_admin(request)
        body = await read_json_body(request, self.max_body_bytes)
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r}", unknown[0])
        name = body.get("lora_name")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or not name.isprintable():
            raise APIError(400, f"lora_name must be a printable string of 1 to {MAX_NAME_CHARS} characters",
                           "lora_name")
        if name == self.base_model:
            raise APIError(400, f"lora_name {name!r} is the base model's name", "lora_name")
        return body

    async def load(self, request: Request) -> JSONResponse:
        body = await self._body(request, _LOAD_FIELDS)
        name, path = body["lora_name"], body.get("lora_path")
        if not isinstance(path, str):
            raise APIError(400, "lora_path must be a string", "lora_path")
        if not self.replica.core.info.max_loras:
            raise APIError(400, "this replica serves no LoRA adapters: start it with --max-loras", "lora_name")
        try:
            ref = await self.load_files(name, path)
        except AdapterError as exc:
            log.info("refused LoRA adapter %r from %r: %s", name, path, exc)
            raise APIError(400, f"{exc.field}: {exc.message}", exc.field, "invalid_lora_adapter") from None
        return JSONResponse({"lora_name": ref.name, "digest": ref.digest, "rank": ref.rank,
                             "message": f"Success: LoRA adapter '{name}' added successfully."})

    async def load_files(self, name: str, path: str, expected_digest: str | None = None):
        """Check the adapter at `path` (inside --lora-dir) and load it under `name`; the LoraRef. With
        `expected_digest`, other bytes are refused before the engine reads them (and after, should the files
        change in between). Raises AdapterError naming what is wrong. Measures the load for the registry."""
        core = self.replica.core
        started = time.perf_counter()
        # Reading and hashing may take a while: off the event loop, then the engine's load between steps.
        files = await asyncio.to_thread(read_adapter, path, self.lora_dir, core.info.max_lora_rank or 1)
        if expected_digest is not None and files.digest != expected_digest:
            raise AdapterError("lora_path", f"{path!r} holds other weights than the digest asked for")
        ref = await asyncio.to_thread(self.replica.loop.call, core.load_lora, name, files.path)
        if expected_digest is not None and ref.digest != expected_digest:  # rewritten while we read it
            await asyncio.to_thread(self.replica.loop.call, core.unload_lora, name)
            self.on_change()
            raise AdapterError("lora_path", f"{path!r} changed while it was loaded")
        self.last_load_seconds = time.perf_counter() - started
        self.on_change()
        return ref

    async def unload(self, request: Request) -> JSONResponse:
        body = await self._body(request, _UNLOAD_FIELDS)
        try:
            ref = await asyncio.to_thread(self.replica.loop.call, self.replica.core.unload_lora, body["lora_name"])
        except AdapterError as exc:
            raise APIError(404, exc.message, "lora_name", "lora_not_found") from None
        self.on_change()
        return JSONResponse({"lora_name": ref.name, "digest": ref.digest,
                             "message": f"Success: LoRA adapter '{ref.name}' removed successfully."})
