"""`pagedserve wait-for-disconnect`, the engine's preStop hook, against real TCP connections: it waits
while a client is connected to exactly the engine's address (not another pod's engine on the same port
of another address), returns once the client leaves, and gives up at its timeout."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

from services.commands.ports import free_port
from services.commands.prestop import established_connections


def listen(host: str, port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen()
    return server


def wait_cmd(host: str, port: int, timeout: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.commands.cli", "wait-for-disconnect",
                             f"--engine=tcp://{host}:{port}", f"--timeout={timeout}", "--interval=0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_waits_for_the_client_of_its_own_address_only():
    port = free_port()
    ours, theirs = listen("127.0.0.1", port), listen("127.0.0.2", port)
    client = socket.create_connection(("127.0.0.1", port))
    other = socket.create_connection(("127.0.0.2", port))
    accepted = [ours.accept()[0], theirs.accept()[0]]
    try:
        assert established_connections("127.0.0.1", port) == 1
        assert established_connections("127.0.0.3", port) == 0
        started = time.monotonic()
        proc = wait_cmd("127.0.0.1", port, timeout=30)
        threading.Timer(1.0, client.close).start()
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert 1.0 <= time.monotonic() - started < 10, "returned before the client left, or long after"
        assert "waiting up to 30s for 1 client(s)" in out
        # 127.0.0.2's client is another pod's scheduler: it never held this hook up.
        assert established_connections("127.0.0.2", port) == 1
    finally:
        for s in (client, other, ours, theirs, *accepted):
            s.close()


def test_gives_up_at_its_timeout():
    port = free_port()
    server = listen("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    try:
        started = time.monotonic()
        proc = wait_cmd("127.0.0.1", port, timeout=1)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and time.monotonic() - started >= 1
        assert "still connected after 1s" in err
    finally:
        for s in (client, conn, server):
            s.close()
