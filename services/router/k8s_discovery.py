"""Kubernetes readiness as a second opinion on the Redis registry (`--discovery kubernetes`).

Watches the EndpointSlices of the schedulers' headless Service and allows only replicas whose pod is
ready there, so a pod failing its readiness probe (or terminating) gets no traffic even while its Redis
heartbeat lingers. Until the first list arrives nothing is allowed: an unready cluster view must not
route blindly. A broken watch keeps the last known view and reconnects with backoff.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from urllib.parse import urlparse

from services.registry.model import ReplicaInfo

log = logging.getLogger(__name__)

_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def ready_endpoints(endpoint_slice) -> tuple[set[str], set[str]]:
    """(ready addresses, ready pod names) of one EndpointSlice (a kubernetes client V1EndpointSlice)."""
    addresses: set[str] = set()
    pods: set[str] = set()
    for ep in endpoint_slice.endpoints or []:
        conditions = ep.conditions
        # The API says a missing `ready` means ready; terminating endpoints report ready=false.
        if conditions is not None and conditions.ready is False:
            continue
        addresses.update(ep.addresses or [])
        if ep.target_ref is not None and ep.target_ref.name:
            pods.add(ep.target_ref.name)
    return addresses, pods


class EndpointSliceDiscovery:
    def __init__(self, service: str, namespace: str | None = None):
        if not service:
            raise ValueError("--discovery kubernetes needs --k8s-service (the schedulers' headless Service)")
        self.service = service
        self.namespace = namespace or (_NAMESPACE_FILE.read_text().strip() if _NAMESPACE_FILE.exists()
                                       else "default")
        self._slices: dict[str, tuple[set[str], set[str]]] = {}
        self._addresses: frozenset[str] = frozenset()
        self._pods: frozenset[str] = frozenset()
        self.synced = False
        self._stop = threading.Event()

    # -- the view ---------------------------------------------------------------------------------
    def allows(self, info: ReplicaInfo) -> bool:
        return urlparse(info.url).hostname in self._addresses or info.replica_id in self._pods

    def apply(self, event_type: str, endpoint_slice) -> None:
        name = endpoint_slice.metadata.name
        if event_type == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = ready_endpoints(endpoint_slice)
        self._recompute()

    def replace_all(self, slices) -> None:
        self._slices = {s.metadata.name: ready_endpoints(s) for s in slices}
        self._recompute()
        self.synced = True

    def _recompute(self) -> None:
        # Rebuilt and swapped whole, so readers on the event loop never see a half-updated set.
        self._addresses = frozenset(a for addrs, _ in self._slices.values() for a in addrs)
        self._pods = frozenset(p for _, pods in self._slices.values() for p in pods)

    # -- the watch --------------------------------------------------------------------------------
    def start(self, api=None, watcher_factory=None) -> None:
        """Watch in a daemon thread; `api`/`watcher_factory` default to the kubernetes client, configured
        from $KUBECONFIG when set (a router run outside the cluster), else from the pod's service account."""
        if api is None:
            from kubernetes import client, config, watch

            if os.environ.get("KUBECONFIG"):
                config.load_kube_config()
            else:
                config.load_incluster_config()
            api, watcher_factory = client.DiscoveryV1Api(), watch.Watch
        threading.Thread(target=self._run, args=(api, watcher_factory), name="endpointslice-watch",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, api, watcher_factory) -> None:
        selector = f"kubernetes.io/service-name={self.service}"
        backoff = 0.5
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                self.replace_all(listing.items)
                backoff = 0.5
                stream = watcher_factory().stream(api.list_namespaced_endpoint_slice, self.namespace,
                                                  label_selector=selector,
                                                  resource_version=listing.metadata.resource_version,
                                                  timeout_seconds=300)
                for event in stream:
                    if self._stop.is_set():
                        return
                    self.apply(event["type"], event["object"])
            except Exception as exc:
                log.warning("EndpointSlice watch of %s/%s failed (%s); keeping the last view, retrying in %.1fs",
                            self.namespace, self.service, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
