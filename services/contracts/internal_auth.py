"""The token routers and schedulers share, so the internal hops are no open doors.

With it configured, a scheduler serves completions only to callers presenting it (its router; in
Kubernetes, a pod that can reach the scheduler's port but not the token gets 401), and registry records
are signed with it (HMAC-SHA256), so a process that can write to Redis cannot register a fake replica
that routers would send prompts to. `pagedserve up` and `pagedserve serve` generate one; the Helm chart
keeps it in a Secret. Without one (a development setup), both hops are open, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

HEADER = "x-pagedserve-internal-token"
ENV = "PAGEDSERVE_INTERNAL_TOKEN"


class InternalToken:
    def __init__(self, token: str):
        if not token:
            raise ValueError("the internal token is empty")
        self._token = token.encode()

    @classmethod
    def generate(cls) -> InternalToken:
        return cls(secrets.token_urlsafe(32))

    @classmethod
    def from_sources(cls, token_file: str | None, token: str | None) -> InternalToken | None:
        """From --internal-token-file (preferred: nothing on a command line) or --internal-token; a file
        that exists but is empty is an error, not an open door."""
        if token_file:
            text = Path(token_file).read_text().strip()
            if not text:
                raise ValueError(f"internal token file {token_file} is empty")
            return cls(text)
        return cls(token) if token else None

    @property
    def value(self) -> str:
        return self._token.decode()

    def env(self) -> dict[str, str]:
        """How a child process receives it (the environment, never argv: /proc/<pid>/cmdline is public)."""
        return {ENV: self.value}

    def accepts(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self._token)

    def sign(self, payload: bytes) -> str:
        return hmac.new(self._token, payload, hashlib.sha256).hexdigest()

    def verify(self, payload: bytes, signature: str | None) -> bool:
        return signature is not None and hmac.compare_digest(self.sign(payload), signature)
