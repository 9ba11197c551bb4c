"""A Kubernetes API server on loopback for the one thing pods of this chart ask it: EndpointSlices.

It serves list and watch of discovery.k8s.io/v1 EndpointSlices by label selector, computed from the
local cluster's pods as the EndpointSlice controller would (ready, serving, terminating), and it
enforces what the chart's RBAC grants: a request must carry the token of a ServiceAccount that a
rendered RoleBinding binds to a Role allowing that verb on endpointslices in that namespace.

A pod that mounts its service account token (automountServiceAccountToken: true) gets the token and
this server's address as a kubeconfig ($KUBECONFIG): the client library reads the in-cluster token
from a fixed path, which a process here cannot be given.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

from tests.json_http import send_json

ADDRESS = "127.77.3.1"
_PATH = "/apis/discovery.k8s.io/v1/namespaces/"


class FakeApiServer:
    def __init__(self, cluster, work: Path):
        self.cluster = cluster
        self.tokens: dict[str, str] = {}  # token -> "namespace/serviceaccount"
        self.requests: list[tuple[str, str, int]] = []  # (service account, verb, status)
        self.watches_open = 0
        self._version = 1
        self._stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a watch streams until the connection closes

            def do_GET(self):  # noqa: N802 (http.server's naming)
                server.handle(self)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer((ADDRESS, 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://{ADDRESS}:{self.http.server_address[1]}"
        self.work = work
        threading.Thread(target=self.http.serve_forever, daemon=True, name="fake-apiserver").start()

    # -- credentials -------------------------------------------------------------------------------
    def kubeconfig_for(self, namespace: str, service_account: str) -> Path:
        token = secrets.token_hex(16)
        self.tokens[token] = f"{namespace}/{service_account}"
        path = self.work / f"kubeconfig-{service_account}-{token[:6]}"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": service_account, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "local", "user": service_account,
                                                     "namespace": namespace}}]}))
        return path

    def allowed(self, account: str, namespace: str, verb: str) -> bool:
        """What the rendered Role and RoleBinding grant this ServiceAccount."""
        sa_namespace, sa_name = account.split("/")
        rendered = self.cluster.rendered
        for binding in rendered.of_kind("RoleBinding"):
            if binding["metadata"]["namespace"] != namespace:
                continue
            if not any(s["kind"] == "ServiceAccount" and s["name"] == sa_name and s.get("namespace") == sa_namespace
                       for s in binding["subjects"]):
                continue
            role = rendered.get("Role", binding["roleRef"]["name"])
            for rule in role["rules"]:
                if "discovery.k8s.io" in rule["apiGroups"] and "endpointslices" in rule["resources"] \
                        and verb in rule["verbs"]:
                    return True
        return False

    # -- requests ----------------------------------------------------------------------------------
    def handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlparse(req.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        watch = query.get("watch", "").lower() in ("true", "1")
        verb = "watch" if watch else "list"
        token = (req.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        account = self.tokens.get(token)
        if not url.path.startswith(_PATH) or not url.path.endswith("/endpointslices"):
            return self._status(req, account, verb, 404, "NotFound")
        namespace = url.path[len(_PATH):].split("/")[0]
        if account is None:
            return self._status(req, account, verb, 401, "Unauthorized")
        if not self.allowed(account, namespace, verb):
            return self._status(req, account, verb, 403, "Forbidden")
        service = query.get("labelSelector", "").removeprefix("kubernetes.io/service-name=")
        self.requests.append((account, verb, 200))
        if not watch:
            body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self._version)}, "items": self._slices(namespace, service)}
            return send_json(req, 200, body)
        self._watch(req, namespace, service, float(query.get("timeoutSeconds", 300)))

    def _slices(self, namespace: str, service: str) -> list[dict]:
        if namespace != self.cluster.namespace:
            return []
        found = [s for s in self.cluster.rendered.of_kind("Service") if s["metadata"]["name"] == service]
        return [self._versioned(self.cluster.endpoint_slice(s)) for s in found]

    def _versioned(self, endpoint_slice: dict) -> dict:
        endpoint_slice["metadata"]["resourceVersion"] = str(self._version)
        return endpoint_slice

    def _watch(self, req, namespace: str, service: str, timeout: float) -> None:
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.end_headers()
        self.watches_open += 1
        last = {s["metadata"]["name"]: s["endpoints"] for s in self._slices(namespace, service)}
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and not self._stop.is_set():
                time.sleep(0.2)
                for current in self._slices(namespace, service):
                    name = current["metadata"]["name"]
                    if last.get(name) != current["endpoints"]:
                        self._version += 1
                        last[name] = current["endpoints"]
                        event = {"type": "MODIFIED", "object": self._versioned(current)}
                        req.wfile.write(json.dumps(event).encode() + b"\n")
                        req.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.watches_open -= 1

    def _status(self, req, account, verb: str, code: int, reason: str) -> None:
        self.requests.append((account or "anonymous", verb, code))
        send_json(req, code, {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": reason,
                               "code": code, "message": f"{verb} endpointslices: {reason}"})

    def close(self) -> None:
        self._stop.set()
        self.http.shutdown()
