"""EndpointSlice discovery: only replicas whose pod is ready in the schedulers' Service are routable."""

from __future__ import annotations

from kubernetes.client import (
    V1Endpoint,
    V1EndpointConditions,
    V1EndpointSlice,
    V1EndpointSliceList,
    V1ListMeta,
    V1ObjectMeta,
    V1ObjectReference,
)

from services.registry.model import ReplicaInfo
from services.router.k8s_discovery import EndpointSliceDiscovery


def _slice(name: str, endpoints: list[tuple[str, str, bool | None]]) -> V1EndpointSlice:
    return V1EndpointSlice(
        address_type="IPv4", metadata=V1ObjectMeta(name=name),
        endpoints=[V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready),
                              target_ref=V1ObjectReference(kind="Pod", name=pod))
                   for ip, pod, ready in endpoints])


def _info(replica_id: str, ip: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id=replica_id, url=f"http://{ip}:8100", model="m", block_size=16,
                       max_model_len=2048, capacity=8, hash_seed=1)


def test_ready_endpoints_gate_replicas():
    d = EndpointSliceDiscovery("schedulers", namespace="ns")
    a, b, c = _info("pod-a", "10.0.0.1"), _info("pod-b", "10.0.0.2"), _info("pod-c", "10.0.0.3")
    assert not d.allows(a), "nothing is routable before the first list"
    d.replace_all([_slice("s1", [("10.0.0.1", "pod-a", True), ("10.0.0.2", "pod-b", False)]),
                   _slice("s2", [("10.0.0.3", "pod-c", None)])])  # a missing condition means ready
    assert d.synced and d.allows(a) and not d.allows(b) and d.allows(c)
    d.apply("MODIFIED", _slice("s1", [("10.0.0.1", "pod-a", False), ("10.0.0.2", "pod-b", True)]))
    assert not d.allows(a) and d.allows(b)
    d.apply("DELETED", _slice("s2", []))
    assert not d.allows(c)
    # Matching by pod name too: a replica that advertises a DNS name is still found by its pod.
    assert d.allows(ReplicaInfo("pod-b", "http://pod-b.schedulers:8100", "m", 16, 2048, 8, 1))


class FakeDiscoveryApi:
    """The two calls the watch makes, with a scripted list, then events, then a broken connection."""

    def __init__(self, listing, events):
        self.listing, self.events, self.lists = listing, events, 0

    def list_namespaced_endpoint_slice(self, namespace, label_selector, **_):
        assert label_selector == "kubernetes.io/service-name=schedulers" and namespace == "ns"
        self.lists += 1
        return V1EndpointSliceList(items=self.listing, metadata=V1ListMeta(resource_version=str(self.lists)))


class FakeWatch:
    def __init__(self, api: FakeDiscoveryApi, on_drop):
        self.api, self.on_drop = api, on_drop

    def stream(self, func, namespace, **kwargs):
        assert kwargs["resource_version"] == str(self.api.lists)
        yield from self.api.events
        self.api.events = []
        self.on_drop()
        raise ConnectionError("watch connection dropped")  # the loop must re-list and carry on


def test_watch_lists_then_follows_events_and_survives_a_dropped_watch():
    import time

    api = FakeDiscoveryApi([_slice("s1", [("10.0.0.1", "pod-a", True)])],
                           [{"type": "MODIFIED", "object": _slice("s1", [("10.0.0.1", "pod-a", False)])},
                            {"type": "ADDED", "object": _slice("s2", [("10.0.0.2", "pod-b", True)])}])
    a, b = _info("pod-a", "10.0.0.1"), _info("pod-b", "10.0.0.2")
    d = EndpointSliceDiscovery("schedulers", namespace="ns")
    views = []
    d.start(api, lambda: FakeWatch(api, lambda: views.append((d.allows(a), d.allows(b)))))
    deadline = time.monotonic() + 5
    while api.lists < 3:  # listed, watched, lost the watch, listed again (and again)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    d.stop()
    assert views[0] == (False, True)  # the watch's events were applied
    assert d.allows(a) and not d.allows(b)  # after the re-list, the view is the list's again
