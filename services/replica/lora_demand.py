"""Loading a LoRA adapter on demand: the first request a router sends here for an adapter that another
replica's registry record names loads `<--lora-dir>/<name>` once, as vLLM's filesystem resolver does.

The router sends the digest it resolved (services.model_files.lora_files.DIGEST_HEADER, on the hop its internal
token guards), and only those weights are ever served under that name: an adapter resident here under
the same name with other bytes, or files in the directory that hash differently, are refused. Every
refusal (no --lora-dir, missing or bad files, other weights, no room for one more adapter) is a 503
coded `lora_unavailable`, which the router answers by trying its next replica; a client reaching a
replica directly, without the header, still gets the plain 404 for a name not loaded here.

Concurrent requests for one missing adapter share one load. The load goes through the admin's own
path (services.replica.lora_admin): the same checks, the same measured load time for the registry.
"""

from __future__ import annotations

import asyncio
import logging
import re

from services.model_files.lora_files import UNAVAILABLE_CODE, AdapterError
from services.openai_api.errors import APIError
from services.replica.lora_admin import MAX_NAME_CHARS, LoraAdmin

log = logging.getLogger(__name__)

# Adapters a replica holds at most by name (loaded at start, by the admin or on demand): beyond it a
# request for one more is sent elsewhere rather than growing host memory without bound.
DEFAULT_MAX_ADAPTERS = 64
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def unavailable(name: str, why: str) -> APIError:
    return APIError(503, f"the LoRA adapter {name!r} cannot be served here: {why}", "model", UNAVAILABLE_CODE,
                    headers={"Retry-After": "1"})


def loadable_name(name: str) -> bool:
    """A name that is one plain entry of the adapter directory (never a path into or out of it)."""
    return (0 < len(name) <= MAX_NAME_CHARS and name.isprintable() and "/" not in name and "\\" not in name
            and name not in (".", ".."))


class OnDemandLoader:
    def __init__(self, admin: LoraAdmin, adapters: dict, max_adapters: int = DEFAULT_MAX_ADAPTERS):
        """`adapters`: the core's name -> LoraRef map (read only: loads go through `admin`)."""
        self.admin = admin
        self.adapters = adapters
        self.max_adapters = max_adapters
        self._loading: dict[str, asyncio.Task] = {}
        self.loads = 0  # adapters this replica loaded on demand (each name once)

    async def ensure(self, name: str, digest: str) -> None:
        """Return once `name` is loaded here with exactly the weights `digest` names; raise the retryable
        503 otherwise (a bad digest header is the router's bug: a 400 naming it)."""
        if not _DIGEST.match(digest):
            raise APIError(400, "x-pagedserve-lora-digest must be a sha256 hex digest", "x-pagedserve-lora-digest")
        ref = self.adapters.get(name)
        if ref is not None:
            if ref.digest != digest:
                raise unavailable(name, f"this replica holds other weights under that name ({ref.digest[:12]})")
            return
        task = self._loading.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(name, digest))
            self._loading[name] = task
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        # Shielded: a client that leaves must not cancel the load the others wait on.
        await asyncio.shield(task)
        ref = self.adapters.get(name)
        if ref is None or ref.digest != digest:  # another digest's load won the race for the name
            raise unavailable(name, "this replica holds other weights under that name")

    async def _load(self, name: str, digest: str) -> None:
        if not self.admin.lora_dir:
            raise unavailable(name, "this replica loads no adapters on demand (no --lora-dir)")
        if not self.admin.replica.core.info.max_loras:
            raise unavailable(name, "this replica serves no LoRA adapters (no --max-loras)")
        if not loadable_name(name):
            raise unavailable(name, "the name is not an entry of the adapter directory")
        if len(self.adapters) >= self.max_adapters:
            raise unavailable(name, f"{len(self.adapters)} adapters are loaded, the most this replica holds")
        try:
            ref = await self.admin.load_files(name, name, digest)
        except AdapterError as exc:
            log.info("could not load LoRA adapter %r on demand: %s", name, exc)
            raise unavailable(name, f"{exc.field}: {exc.message}") from None
        self.loads += 1
        log.info("LoRA adapter %r loaded on demand in %.3fs (digest %s)", name, self.admin.last_load_seconds,
                 ref.digest[:12])
