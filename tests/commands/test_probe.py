"""`pagedserve probe engine` against a real engine process (tiny random Llama): healthy while its loop
answers, failing while the process is frozen although TCP connections to it still succeed (which is
why a TCP check cannot be the engine's liveness probe), healthy again once it runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from services.commands.ports import free_port
from services.commands.probe import engine_health
from tests.transport.test_engine_server import start_engine


def probe(url: str, timeout: float = 2.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.commands.cli", "probe", "engine", f"--engine={url}",
                           f"--timeout={timeout}"], capture_output=True, text=True, timeout=60)


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not engine_health(url, 1.0)[0]:
        assert time.monotonic() < deadline, f"engine at {url} never answered"


def test_probe_follows_the_engine_loop_not_its_socket(tiny_llama_dir):
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = start_engine(tiny_llama_dir, port)
    try:
        wait_healthy(url)
        ok = probe(url)
        assert ok.returncode == 0 and "healthy" in ok.stdout
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            socket.create_connection(("127.0.0.1", port), 3).close()  # the old probe: still passes
            started = time.monotonic()
            frozen = probe(url, timeout=1.5)
            assert frozen.returncode == 1
            assert f"engine at {url} did not answer health within 1.5s" in frozen.stderr
            assert time.monotonic() - started < 10
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert probe(url).returncode == 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_probe_fails_when_nothing_listens():
    result = probe(f"tcp://127.0.0.1:{free_port()}", timeout=0.5)
    assert result.returncode == 1 and "did not answer" in result.stderr
