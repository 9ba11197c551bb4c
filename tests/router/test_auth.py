"""API keys fail closed (configured but empty refuses to start) and rotate without a restart."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.openai_api.errors import APIError
from services.router import auth
from services.router.auth import ApiKeys, NoKeysError


def test_keys_configured_but_empty_refuse_to_start(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# every key was revoked\n\n")
    with pytest.raises(NoKeysError, match="holds no key"):
        ApiKeys.from_sources(str(empty), None)
    with pytest.raises(NoKeysError, match="holds no key"):
        ApiKeys.from_sources(None, " , ")
    assert not ApiKeys.from_sources(None, None).enabled  # nothing configured: open, by choice


def test_the_router_refuses_to_start_with_an_empty_key_file(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("")
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "router", "--redis-url", "redis://127.0.0.1:1",
                           "--api-keys-file", str(empty)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "holds no key" in done.stderr
    env = {**os.environ, "PAGEDSERVE_API_KEYS": ""}  # a Secret mounted with an empty value
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "router", "--redis-url", "redis://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "holds no key" in done.stderr


def test_a_rewritten_key_file_rotates_keys_and_an_emptied_one_keeps_them(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "RELOAD_INTERVAL", 0.0)
    path = tmp_path / "keys"
    path.write_text("sk-old\n")
    keys = ApiKeys.from_sources(str(path), "sk-fixed")
    assert keys.check("Bearer sk-old") == b"sk-old" and keys.check("Bearer sk-fixed") == b"sk-fixed"
    # Kubernetes swaps a Secret volume's files through a symlink: a new inode, maybe the same size.
    new = tmp_path / "keys.new"
    new.write_text("sk-new\n")
    os.replace(new, path)
    assert keys.check("Bearer sk-new") == b"sk-new" and keys.check("Bearer sk-fixed") == b"sk-fixed"
    with pytest.raises(APIError) as exc:
        keys.check("Bearer sk-old")
    assert exc.value.status == 401
    path.write_text("\n")
    assert keys.check("Bearer sk-new") == b"sk-new"  # never open, never locked out by a bad rewrite
