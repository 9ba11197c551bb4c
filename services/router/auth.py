"""Optional API keys: `Authorization: Bearer <key>` checked against keys from a file and/or a list.

Fail closed: keys asked for but none found (an empty file, an empty Secret) is a refusal to start, never
an open endpoint. The key file is re-read when it changes (Kubernetes updates a mounted Secret in place),
so keys rotate without a restart; a rewrite that leaves it empty keeps the previous keys, loudly.
Comparison is constant-time and visits every key, so response timing reveals neither how much of a
guess was right nor which key it was close to.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from pathlib import Path

from services.openai_api.errors import APIError

log = logging.getLogger(__name__)

RELOAD_INTERVAL = 1.0  # seconds between looks at the key file


class NoKeysError(ValueError):
    """API keys were configured, but the source holds none."""


def _read_key_file(path: str) -> list[str]:
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def _split(csv: str) -> list[str]:
    return [k.strip() for k in csv.split(",") if k.strip()]


class ApiKeys:
    def __init__(self, keys: list[str], keys_file: str | None = None, fixed: list[str] | None = None):
        self._keys = [k.encode() for k in keys if k]
        self._file = keys_file
        self._fixed = list(fixed or [])  # keys from the flag/env: kept across reloads of the file
        self._stamp = self._file_stamp()
        self._checked_at = time.monotonic()

    @classmethod
    def from_sources(cls, keys_file: str | None, keys_csv: str | None) -> ApiKeys:
        """None for both: no keys (an open endpoint, by choice). Anything configured must yield keys."""
        fixed = _split(keys_csv) if keys_csv is not None else []
        if keys_csv is not None and not fixed:
            raise NoKeysError("--api-keys (PAGEDSERVE_API_KEYS) is set but holds no key; refusing to start open")
        from_file = []
        if keys_file:
            from_file = _read_key_file(keys_file)
            if not from_file:
                raise NoKeysError(f"API key file {keys_file} holds no key; refusing to start open")
        return cls(from_file + fixed, keys_file, fixed)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def _file_stamp(self) -> tuple | None:
        if not self._file:
            return None
        try:
            st = os.stat(self._file)  # follows symlinks: a Secret volume swaps its ..data link
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino, st.st_size

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self._file is None or now - self._checked_at < RELOAD_INTERVAL:
            return
        self._checked_at = now
        stamp = self._file_stamp()
        if stamp == self._stamp or stamp is None:
            return
        self._stamp = stamp
        try:
            keys = _read_key_file(self._file)
        except OSError as exc:
            log.error("cannot re-read API key file %s (%s); keeping the previous keys", self._file, exc)
            return
        if not keys:
            log.error("API key file %s is now empty; keeping the previous keys (never open)", self._file)
            return
        self._keys = [k.encode() for k in keys + self._fixed]
        log.info("API keys reloaded from %s: %d keys", self._file, len(self._keys))

    def check(self, authorization: str | None) -> bytes | None:
        """The accepted key the header carries (None when no keys are configured); else a 401."""
        self._maybe_reload()
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
