"""The kubelet's probes and lifecycle handlers for one container of tests.chart_e2e.kubelet: exec (the
command in the container's environment), httpGet and tcpSocket (to the pod's address), sleep; startup
gates readiness and liveness, failing liveness (or startup) restarts the container with the probe's
grace period, readiness decides whether the pod is in its Services' endpoints.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass
class ProbeState:
    successes: int = 0
    failures: int = 0


def run_handler(container, handler: dict, timeout: float) -> bool:
    """Run a probe or lifecycle handler (exec, httpGet, tcpSocket, sleep) as the kubelet does: True on success."""
    if "sleep" in handler:
        time.sleep(min(timeout, handler["sleep"]["seconds"]))
        return True
    if "exec" in handler:
        rw = container.pod.rewriter_for(container)
        argv = container.on_image_path([rw(a) for a in handler["exec"]["command"]])
        try:
            done = subprocess.run(argv, env=container.env(), cwd=container.pod.workdir(container), capture_output=True,
                                  timeout=max(0.1, timeout), stdin=subprocess.DEVNULL)
            return done.returncode == 0
        except subprocess.TimeoutExpired:
            return False
    if "httpGet" in handler:
        get = handler["httpGet"]
        url = f"http://{container.pod.ip}:{port_number(container, get['port'])}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        except urllib.error.HTTPError as exc:
            return 200 <= exc.code < 400
        except OSError:
            return False
    if "tcpSocket" in handler:
        try:
            socket.create_connection((container.pod.ip, port_number(container, handler["tcpSocket"]["port"])),
                                     timeout).close()
            return True
        except OSError:
            return False
    raise AssertionError(f"unsupported handler {handler}")

def port_number(container, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container.spec.get("ports", []) if p["name"] == port)

def probe_loops(container) -> list[threading.Thread]:
    """One thread per probe kind (startup, readiness, liveness), each polling as the spec says."""
    return [threading.Thread(target=_probe_loop, args=(container, kind), daemon=True,
                             name=f"{container.pod.name}/{container.name}/{kind}")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe")]

def _probe_loop(container, kind: str) -> None:
    probe = container.spec.get(kind)
    generation = -1
    state = ProbeState()
    next_at = 0.0
    while not container.pod.deleted:
        if container.generation != generation:  # a new run of the container: probes start over
            generation, state = container.generation, ProbeState()
            next_at = time.monotonic() + ((probe or {}).get("initialDelaySeconds", 0))
            if probe is None:
                if kind == "startupProbe":
                    container.started = True
                elif kind == "readinessProbe":
                    _set_ready_after_start(container, generation)
        if probe is None or (kind != "startupProbe" and not container.started) or \
                (kind == "startupProbe" and container.started) or time.monotonic() < next_at or not container.alive():
            time.sleep(0.05)
            continue
        next_at = time.monotonic() + probe.get("periodSeconds", 10)
        ok = container.run_handler(probe, timeout=probe.get("timeoutSeconds", 1))
        if container.generation != generation or container.pod.deleted:
            continue
        if ok:
            state.successes, state.failures = state.successes + 1, 0
        else:
            state.successes, state.failures = 0, state.failures + 1
        _apply(container, kind, probe, state, ok)

def _set_ready_after_start(container, generation: int) -> None:
    def wait() -> None:
        while not container.started and container.generation == generation and not container.pod.deleted:
            time.sleep(0.05)
        if container.generation == generation and not container.pod.terminating:
            container.ready = True
    threading.Thread(target=wait, daemon=True).start()

def _apply(container, kind: str, probe: dict, state: ProbeState, ok: bool) -> None:
    threshold = probe.get("failureThreshold", 3)
    if kind == "startupProbe":
        if ok:
            container.started = True
            container.event("startup probe passed")
        elif state.failures >= threshold:
            container.pod.cluster.restart_async(container, container.pod.grace(probe), "startup probe failed")
    elif kind == "readinessProbe":
        if ok and state.successes >= probe.get("successThreshold", 1) and not container.pod.terminating:
            if not container.ready:
                container.event("ready")
            container.ready = True
        elif not ok and state.failures >= threshold:
            if container.ready:
                container.event("not ready (readiness probe failed)")
            container.ready = False
    elif not ok and state.failures >= threshold:
        container.event(f"liveness probe failed {state.failures} times")
        container.pod.cluster.restart_async(container, container.pod.grace(probe), "liveness probe failed")
