"""The rendered release on one machine: pods of its Deployments and StatefulSets (tests.chart_e2e.kubelet),
its Services as kube-proxy would route them, and the EndpointSlices the control plane would publish.

Every ClusterIP Service gets a loopback address (127.77.2.N), forwarding each new connection to a ready,
not terminating pod that the Service selects (round robin), and its DNS names (<svc>.<ns>,
<svc>.<ns>.svc, <svc>.<ns>.svc.cluster.local, with the port) are rewritten to that address in what
containers are given (args, env, Secret values). The proxy listens on the Service port + 20000: a pod
here shares the machine's ports, and a server binding all addresses (Redis does) would otherwise
collide with the Service in front of it. Headless Services get no address, only EndpointSlices.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
from pathlib import Path

from tests.chart_e2e.images import Image
from tests.chart_e2e.kubelet import Container, Pod, decode_data
from tests.charts.chart_render import pod_labels, pod_spec, selector_matches

POD_NET = "127.77.1."
SERVICE_NET = "127.77.2."
SERVICE_PORT_OFFSET = 20000


class ServiceProxy:
    """kube-proxy for one ClusterIP Service port: new connections go to a ready endpoint, or are refused."""

    def __init__(self, cluster: Cluster, service: dict, ip: str, port: dict):
        self.cluster, self.service, self.ip, self.port = cluster, service, ip, port
        self._next = itertools.count()
        self.connections = 0

    def endpoints(self) -> list[tuple[str, int]]:
        out = []
        for pod in self.cluster.selected_pods(self.service):
            if pod.ready:
                out.append((pod.ip, self._target_port(pod)))
        return out

    def _target_port(self, pod: Pod) -> int:
        target = self.port.get("targetPort", self.port["port"])
        if isinstance(target, int):
            return target
        for c in pod.containers:
            for p in c.spec.get("ports", []):
                if p["name"] == target:
                    return p["containerPort"]
        raise AssertionError(f"{pod.name} has no port {target}")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoints = self.endpoints()
        if not endpoints:
            writer.close()
            return
        host, port = endpoints[next(self._next) % len(endpoints)]
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                try:
                    dst.close()
                except OSError:
                    pass

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


class Cluster:
    def __init__(self, work: Path, rendered, images: dict[str, Image], namespace: str):
        self.work = work
        self.rendered = rendered
        self.images = images
        self.namespace = namespace
        self.pods: dict[str, Pod] = {}
        self.events: list[str] = []
        self._ips = itertools.count(10)
        self._restarting: set[int] = set()
        self._lock = threading.Lock()
        self.service_names: dict[str, tuple[str, dict[int, int]]] = {}  # DNS name -> (ip, port -> proxy port)
        self.apiserver = None  # a tests.chart_e2e.fake_apiserver.FakeApiServer, when pods need one
        self.proxies: list[ServiceProxy] = []
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="kube-proxy").start()
        self._servers = []
        for i, service in enumerate(rendered.of_kind("Service"), start=1):
            self.add_service(service, f"{SERVICE_NET}{i}")

    # -- objects -----------------------------------------------------------------------------------
    def object_data(self, kind: str, name: str) -> dict[str, bytes]:
        data = decode_data(self.rendered.get(kind, name))
        # Values hold Service DNS names too (the Redis URL): a pod here reaches them at loopback addresses.
        return {k: self._rewrite_names(v) for k, v in data.items()}

    def _rewrite_names(self, value: bytes) -> bytes:
        return self.rewrite_names(value.decode(errors="surrogateescape")).encode(errors="surrogateescape")

    def rewrite_names(self, text: str) -> str:
        """Service DNS names (and their ports) to the Service proxies' loopback addresses."""
        if not self.service_names:
            return text
        names = "|".join(re.escape(n) for n in sorted(self.service_names, key=len, reverse=True))

        def to_proxy(match: re.Match) -> str:
            ip, ports = self.service_names[match.group(1)]
            port = int(match.group(2)) if match.group(2) else next(iter(ports))
            return f"{ip}:{ports[port]}"

        return re.sub(rf"(?<![\w.-])({names})(?::(\d+))?(?![\w-])", to_proxy, text)

    def add_service(self, service: dict, ip: str) -> None:
        if service["spec"].get("clusterIP") == "None":
            return
        name, ns = service["metadata"]["name"], self.namespace
        ports = {p["port"]: p["port"] + SERVICE_PORT_OFFSET for p in service["spec"]["ports"]}
        for dns in (f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc", f"{name}.{ns}"):
            self.service_names[dns] = (ip, ports)
        for port in service["spec"]["ports"]:
            proxy = ServiceProxy(self, service, ip, port)
            self.proxies.append(proxy)
            server = asyncio.run_coroutine_threadsafe(asyncio.start_server(proxy.handle, ip, ports[port["port"]]),
                                                      self._loop).result(10)
            self._servers.append(server)

    def service_url(self, name: str) -> str:
        proxy = next(p for p in self.proxies if p.service["metadata"]["name"] == name)
        return f"http://{proxy.ip}:{proxy.port['port'] + SERVICE_PORT_OFFSET}"

    def selected_pods(self, service: dict) -> list[Pod]:
        selector = {"matchLabels": service["spec"]["selector"]}
        return [p for p in self.pods.values() if not p.deleted and selector_matches(selector, p.labels)]

    # -- pods --------------------------------------------------------------------------------------
    def new_pod(self, workload: dict, name: str, extra_env: dict | None = None) -> Pod:
        spec = pod_spec(workload)
        env = dict(extra_env or {})
        if spec.get("automountServiceAccountToken"):
            env = {c["name"]: {**env.get(c["name"], {}), **self.service_account_env(spec)} for c in spec["containers"]}
        pod = Pod(self, name, spec, pod_labels(workload), f"{POD_NET}{next(self._ips)}", self.images, env)
        self.pods[name] = pod
        return pod

    def service_account_env(self, spec: dict) -> dict[str, str]:
        """The API credentials a pod with a mounted service account token gets (see fake_apiserver)."""
        if self.apiserver is None:
            return {}
        return {"KUBECONFIG": str(self.apiserver.kubeconfig_for(self.namespace, spec["serviceAccountName"]))}

    def start_workload(self, kind: str, name: str, replicas: int | None = None) -> list[Pod]:
        workload = self.rendered.get(kind, name)
        count = workload["spec"].get("replicas", 1) if replicas is None else replicas
        pods = []
        for i in range(count):
            pod_name = f"{name}-{i}" if kind == "StatefulSet" else f"{name}-{self._suffix()}"
            pods.append(self.new_pod(workload, pod_name))
        threads = [threading.Thread(target=p.run) for p in pods]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return pods

    def _suffix(self) -> str:
        return f"{next(self._ips):05x}"

    def restarting(self, container: Container) -> bool:
        return id(container) in self._restarting

    def restart_async(self, container: Container, grace: float, reason: str) -> None:
        with self._lock:
            if id(container) in self._restarting:
                return
            self._restarting.add(id(container))

        def go() -> None:
            try:
                container.restart(grace, reason)
            finally:
                self._restarting.discard(id(container))

        threading.Thread(target=go, daemon=True).start()

    def delete_pod(self, pod: Pod) -> None:
        pod.delete()
        del self.pods[pod.name]

    def pods_of(self, component: str) -> list[Pod]:
        return [p for p in self.pods.values() if p.labels.get("app.kubernetes.io/component") == component
                and not p.deleted]

    def wait(self, predicate, timeout: float, what: str) -> float:
        started = time.monotonic()
        while not predicate():
            if time.monotonic() - started > timeout:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n" + self.diagnostics())
            time.sleep(0.1)
        return time.monotonic() - started

    def diagnostics(self) -> str:
        lines = ["events:", *self.events[-40:]]
        for pod in self.pods.values():
            for c in pod.containers:
                if c.log_path and c.log_path.exists():
                    tail = c.log_path.read_text(errors="replace").splitlines()[-15:]
                    lines += [f"--- {pod.name}/{c.name} (ready={c.ready}, restarts={c.restarts}):", *tail]
        return "\n".join(lines)

    # -- EndpointSlices ----------------------------------------------------------------------------
    def endpoint_slice(self, service: dict) -> dict:
        """The EndpointSlice the control plane would publish for `service` now."""
        name = service["metadata"]["name"]
        endpoints = []
        for pod in self.selected_pods(service):
            endpoints.append({"addresses": [pod.ip], "targetRef": {"kind": "Pod", "name": pod.name,
                                                                    "namespace": self.namespace},
                              "conditions": {"ready": pod.ready, "serving": pod.ready,
                                             "terminating": pod.terminating}})
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": f"{name}-slice", "namespace": self.namespace,
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4", "endpoints": endpoints,
                "ports": [{"name": p["name"], "port": p["port"], "protocol": p.get("protocol", "TCP")}
                          for p in service["spec"]["ports"]]}

    def close(self) -> None:
        for pod in list(self.pods.values()):
            for c in pod.containers + pod.init_containers:
                c.signal(9)
            pod.deleted = True
        async def shutdown() -> None:
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
