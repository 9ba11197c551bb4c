"""Optional API keys: `Authorization: Bearer <key>` checked against a set loaded at start-up.

Comparison is constant-time and visits every key, so response timing reveals neither how much of a
guess was right nor which key it was close to.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from services.openai_api.errors import APIError


class ApiKeys:
    def __init__(self, keys: list[str]):
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def from_sources(cls, keys_file: str | None, keys_csv: str | None) -> ApiKeys:
        """Keys from a file (one per line) and a comma-separated list. A keys file that holds no key fails
        closed: it means authentication was asked for (e.g. a Secret mounted with an empty key list), and
        silently serving without it would open the endpoint to anyone."""
        keys: list[str] = []
        if keys_file:
            for line in Path(keys_file).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
            if not keys:
                raise ValueError(f"API keys file {keys_file} holds no key; refusing to serve without authentication")
        if keys_csv:
            keys.extend(k.strip() for k in keys_csv.split(",") if k.strip())
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> bytes | None:
        """The accepted key the header carries (None when no keys are configured); else a 401."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        if not presented or not ok:
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return presented
