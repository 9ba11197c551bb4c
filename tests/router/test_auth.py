"""API keys fail closed: a keys file that holds no key stops the router instead of serving without
authentication (an existing Secret mounted with an empty key list must not open the endpoint)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.router.auth import ApiKeys


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n", "   \n# k\n"])
def test_a_keys_file_without_keys_is_refused(tmp_path, content):
    path = tmp_path / "api-keys"
    path.write_text(content)
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.from_sources(str(path), None)


def test_keys_from_file_and_list():
    keys = ApiKeys.from_sources(None, "sk-a, sk-b")
    assert keys.enabled
    keys.check("Bearer sk-b")


def test_the_router_command_exits_on_an_empty_keys_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("\n")
    result = subprocess.run([sys.executable, "-m", "services.cli", "router", "--redis-url", "redis://127.0.0.1:1/0",
                             "--api-keys-file", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "holds no key; refusing to serve without authentication" in result.stderr
