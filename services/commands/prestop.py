"""`pagedserve wait-for-disconnect`: the engine's preStop hook, waiting for its scheduler to exit.

Kubernetes stops the containers of a pod together, but the engine must outlive its scheduler, which
still runs in-flight requests after SIGTERM. The scheduler holds a TCP connection to the engine for as
long as it runs, so the hook waits while an established connection to the engine's listening address
remains (read from /proc/net/tcp of the pod's network namespace: no shared process namespace and no
tool in the image needed), bounded by the timeout.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import time
from urllib.parse import urlparse

_ESTABLISHED = "01"
_TABLES = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))


def _proc_address(text: str, family: int) -> tuple[str, int]:
    """/proc/net/tcp's 'HEXIP:HEXPORT' (the IP in host byte order, 32-bit words) as (ip, port)."""
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    # Each 32-bit word is stored little-endian on the architectures Kubernetes runs (x86-64, arm64).
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(packed)
    if family == socket.AF_INET6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(hex_port, 16)


def established_connections(host: str, port: int) -> int:
    """Established TCP connections whose local end is `host:port` (the listening engine's side)."""
    want = str(ipaddress.ip_address(host))
    count = 0
    for table, family in _TABLES:
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == _ESTABLISHED and _proc_address(fields[1], family) == (want, port):
                count += 1
    return count


def run(args) -> int:
    url = urlparse(args.engine)
    host, port = url.hostname or "127.0.0.1", url.port
    deadline = time.monotonic() + args.timeout
    waited = False
    while (n := established_connections(host, port)) and time.monotonic() < deadline:
        if not waited:
            print(f"waiting up to {args.timeout:g}s for {n} client(s) of {host}:{port} to disconnect", flush=True)
            waited = True
        time.sleep(args.interval)
    if n:
        print(f"{n} client(s) of {host}:{port} still connected after {args.timeout:g}s", file=sys.stderr, flush=True)
    return 0
