"""The rendered objects point at each other correctly: Service, PDB, NetworkPolicy and ServiceMonitor
selectors match the pods they mean (and no others), the autoscaler scales the replica Deployment on a
metric the scheduler exports, RBAC grants exactly EndpointSlice reads, Redis clients get the URL of
the Redis the chart runs, and every pod is hardened."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest

from services.contracts import metric_names as M
from tests.charts.chart_render import NAMESPACE, RELEASE, VARIANTS, pod_labels, pod_spec, render, selector_matches

FULLNAME = f"{RELEASE}-pagedserve"
_METRIC = re.compile(r"\bpagedserve_[a-z0-9_]+\b")


def components_selected(rendered, selector: dict) -> set[str]:
    return {pod_labels(w)["app.kubernetes.io/component"] for w in rendered.workloads()
            if selector_matches(selector, pod_labels(w))}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_workload_selectors_match_their_own_pods(variant):
    for workload in render(variant).workloads():
        # A Pod has no selector; the LeaderWorkerSet controller selects its pods by labels of its own.
        if workload["kind"] not in ("Pod", "LeaderWorkerSet"):
            assert selector_matches(workload["spec"]["selector"], pod_labels(workload))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_services_select_the_intended_pods_and_target_named_ports(variant):
    rendered = render(variant)
    expected = {f"{FULLNAME}-router": "router", f"{FULLNAME}-scheduler": "replica", f"{FULLNAME}-redis": "redis"}
    for service in rendered.of_kind("Service"):
        name = service["metadata"]["name"]
        assert components_selected(rendered, {"matchLabels": service["spec"]["selector"]}) == {expected[name]}
        workload = rendered.workload(expected[name])
        port_names = {p["name"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{name}: targetPort {port['targetPort']} is no pod port"
    headless = rendered.get("Service", f"{FULLNAME}-scheduler")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["ports"][0]["port"] == 8100


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pod_disruption_budgets_cover_router_and_replicas(variant):
    rendered = render(variant)
    covered = set()
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        selected = components_selected(rendered, pdb["spec"]["selector"])
        assert len(selected) == 1, selected
        covered |= selected
        assert pdb["spec"]["maxUnavailable"] == 1
    # A worker pod evicted takes its whole group down: replicas spanning nodes budget their workers too.
    assert covered == {"router", "replica"} | ({"replica-worker"} if rendered.of_kind("LeaderWorkerSet") else set())


def _allowed_components(rendered, rule: dict) -> set[str] | None:
    """Components of this release a NetworkPolicy ingress rule lets in (None: any source)."""
    if "from" not in rule:
        return None
    allowed = set()
    for peer in rule["from"]:
        if "podSelector" in peer and "namespaceSelector" not in peer:
            allowed |= components_selected(rendered, peer["podSelector"])
    return allowed


def _ports_of(rendered, component: str, rule: dict) -> set[int]:
    containers = pod_spec(rendered.workload(component))["containers"]
    named = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
    return {named.get(p["port"], p["port"]) for p in rule["ports"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_network_policies_let_in_only_whom_they_mean(variant):
    rendered = render(variant)
    policies = {}
    for policy in rendered.of_kind("NetworkPolicy"):
        selected = components_selected(rendered, policy["spec"]["podSelector"])
        assert len(selected) == 1, f"{policy['metadata']['name']} selects {selected}"
        assert policy["spec"]["policyTypes"] in (["Ingress"], ["Egress"]), "one direction per policy"
        if policy["spec"]["policyTypes"] == ["Ingress"]:
            policies[selected.pop()] = policy["spec"]["ingress"]
    multi_node = bool(rendered.of_kind("LeaderWorkerSet"))
    expected = {"router", "replica"} | ({"redis"} if rendered.of_kind("StatefulSet") else set())
    assert set(policies) == expected | ({"replica-worker"} if multi_node else set())

    # Schedulers: routers only (plus scrapes from other namespaces), on the scheduler port only.
    rule, *ranks = policies["replica"]
    assert _allowed_components(rendered, rule) == {"router"}
    assert _ports_of(rendered, "replica", rule) == {8100}, "only the scheduler port may be reachable"
    engine_port = next(p["containerPort"] for p in rendered.container("engine")["ports"])
    assert all(engine_port not in _ports_of(rendered, "replica", r) for r in policies["replica"] if "ports" in r)
    if multi_node:
        # Rank 0 takes its group's connections (rendezvous, gloo, NCCL: ports they pick) from worker
        # pods only; the worker pods take them from the release's ranks and from nothing else.
        (ranks,) = ranks
        assert "ports" not in ranks and _allowed_components(rendered, ranks) == {"replica-worker"}
        (workers,) = policies["replica-worker"]
        assert "ports" not in workers and _allowed_components(rendered, workers) == {"replica", "replica-worker"}
        assert not [p for p in workers["from"] if "namespaceSelector" in p or "ipBlock" in p]
    else:
        assert not ranks

    # Redis: only this release's routers and schedulers.
    if "redis" in policies:
        (rule,) = policies["redis"]
        assert _allowed_components(rendered, rule) == {"router", "replica"}
        assert not [p for p in rule["from"] if "namespaceSelector" in p]
        assert _ports_of(rendered, "redis", rule) == {6379}

    # Router: the ingress controller (routerFrom), Prometheus and the helm test pod; or anyone.
    (rule,) = policies["router"]
    assert _ports_of(rendered, "router", rule) == {8000}
    allowed = _allowed_components(rendered, rule)
    assert allowed is None or allowed == {"test"}


def test_router_is_reachable_from_the_ingress_controller_namespace():
    (rule,) = next(p for p in render("ingress-tls").of_kind("NetworkPolicy")
                   if p["metadata"]["name"] == f"{FULLNAME}-router")["spec"]["ingress"]
    namespaces = [p["namespaceSelector"]["matchLabels"] for p in rule["from"] if "namespaceSelector" in p]
    assert {"kubernetes.io/metadata.name": "ingress-nginx"} in namespaces
    (rule,) = next(p for p in render("gateway-k8s-discovery").of_kind("NetworkPolicy")
                   if p["metadata"]["name"] == f"{FULLNAME}-router")["spec"]["ingress"]
    namespaces = [p["namespaceSelector"]["matchLabels"] for p in rule["from"] if "namespaceSelector" in p]
    assert {"kubernetes.io/metadata.name": "gateway-system"} in namespaces, "the Gateway's namespace"
    assert {"kubernetes.io/metadata.name": "ingress-nginx"} not in namespaces, "no ingress controller there"


def test_no_network_policies_when_disabled():
    assert not render("default", "--set", "networkPolicy.enabled=false").of_kind("NetworkPolicy")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_autoscaler_at_most_and_it_scales_the_replica_deployment(variant):
    rendered = render(variant)
    # Replicas spanning nodes are LeaderWorkerSet groups; its scale subresource counts groups.
    (replica,) = [o for o in rendered.of_kind("Deployment") + rendered.of_kind("LeaderWorkerSet")
                  if o["metadata"]["name"] == f"{FULLNAME}-replica"]
    router = rendered.get("Deployment", f"{FULLNAME}-router")
    router_hpas = [h for h in rendered.of_kind("HorizontalPodAutoscaler")
                   if h["spec"]["scaleTargetRef"]["name"] == router["metadata"]["name"]]
    assert ("replicas" in router["spec"]) == (not router_hpas)
    hpas = [h for h in rendered.of_kind("HorizontalPodAutoscaler") if h not in router_hpas]
    scaled = rendered.of_kind("ScaledObject")
    assert len(hpas) + len(scaled) <= 1, "the HPA and KEDA must never both scale the replicas"
    for autoscaler in hpas + scaled:
        target = autoscaler["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == (replica["apiVersion"], replica["kind"],
                                                                           replica["metadata"]["name"])
    # An autoscaler owns the count: a `replicas` in the Deployment would reset it on every upgrade.
    assert ("replicas" in replica["spec"]) == (not (hpas or scaled))


def test_hpa_averages_the_schedulers_queue_depth_per_pod():
    hpa = render("gpu").one("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == M.AUTOSCALING_METRIC
    assert M.AUTOSCALING_METRIC in M.SCHEDULER_METRICS
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 16)
    behavior = hpa["spec"]["behavior"]
    # Sized for GPU pods that take minutes to start: slow, rate-limited scale-down.
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] < behavior["scaleDown"]["stabilizationWindowSeconds"]
    assert all(p["periodSeconds"] >= 60 for p in behavior["scaleUp"]["policies"])


def test_keda_queries_metrics_the_services_export_under_the_scraped_labels():
    rendered = render("keda")
    scaled = rendered.one("ScaledObject")
    assert not rendered.of_kind("HorizontalPodAutoscaler")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    names = set(_METRIC.findall(query))
    assert M.AUTOSCALING_METRIC in names and names <= M.exported_series_names()
    # The query selects series by the Service labels the chart's ServiceMonitors give the targets.
    monitored = {sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
                 for sm in rendered.of_kind("ServiceMonitor")}
    assert monitored == {"router", "replica"}
    for service in re.findall(r'service="([^"]+)"', query):
        rendered.get("Service", service)
    assert f'namespace="{NAMESPACE}"' in query
    assert scaled["spec"]["minReplicaCount"] == 0 and trigger["metadata"]["threshold"] == "2"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_service_monitors_scrape_metrics_ports_of_existing_services(variant):
    rendered = render(variant)
    for sm in rendered.of_kind("ServiceMonitor"):
        services = [s for s in rendered.of_kind("Service")
                    if selector_matches(sm["spec"]["selector"], s["metadata"]["labels"])]
        assert len(services) == 1, f"{sm['metadata']['name']} selects {[s['metadata']['name'] for s in services]}"
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in sm["spec"]["endpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def test_rbac_grants_the_router_endpointslice_reads_and_nothing_more():
    rendered = render("gateway-k8s-discovery")
    role = rendered.one("Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = rendered.one("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    router_sa = pod_spec(rendered.workload("router"))["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router_sa, "namespace": NAMESPACE}]
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    assert not render("default").of_kind("Role"), "Redis discovery needs no API access"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_service_accounts_exist_and_tokens_are_not_mounted_by_default(variant):
    rendered = render(variant)
    accounts = {sa["metadata"]["name"] for sa in rendered.of_kind("ServiceAccount")}
    for workload in rendered.workloads():
        spec = pod_spec(workload)
        if pod_labels(workload)["app.kubernetes.io/component"] != "test":
            assert spec["serviceAccountName"] in accounts
        if pod_labels(workload)["app.kubernetes.io/component"] != "router":
            assert spec["automountServiceAccountToken"] is False


def test_redis_clients_get_the_url_of_the_bundled_redis():
    rendered = render("default")
    secret_name = f"{FULLNAME}-redis"
    url = urlparse(rendered.secret_value(secret_name, "redis-url"))
    service = rendered.get("Service", f"{FULLNAME}-redis")
    assert url.scheme == "redis"
    assert url.hostname == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert url.port == service["spec"]["ports"][0]["port"] == 6379
    password = rendered.secret_value(secret_name, "redis-password")
    assert url.password == password and len(password) >= 32
    redis = pod_spec(rendered.workload("redis"))["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert env["REDIS_PASSWORD"] == {"name": secret_name, "key": "redis-password"}
    # The password reaches redis-server on its standard input, never on a command line.
    assert "--requirepass" not in redis["args"][0] and "exec redis-server - " in redis["args"][0]
    assert '<<EOF\nrequirepass "$REDIS_PASSWORD"\nEOF' in redis["args"][0]
    assert "$(REDIS_PASSWORD)" not in str(redis), "the password must not be expanded into the pod spec"
    for name in ("router", "scheduler"):
        env = {e["name"]: e for e in rendered.container(name)["env"]}
        assert env["PAGEDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": "redis-url"}


def test_external_redis_replaces_the_bundled_one():
    rendered = render("external-redis")
    assert not rendered.of_kind("StatefulSet")
    assert f"{FULLNAME}-redis" not in {s["metadata"]["name"] for s in rendered.of_kind("Service")}
    url = rendered.secret_value(f"{FULLNAME}-redis", "redis-url")
    assert url == "rediss://:s3cret@redis.example.internal:6380/2"
    existing = render("existing-secrets")
    ref = {e["name"]: e for e in existing.container("scheduler")["env"]}["PAGEDSERVE_REDIS_URL"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "llm-redis", "key": "redis-url"}
    assert f"{FULLNAME}-redis" not in {s["metadata"]["name"] for s in existing.of_kind("Secret")}


def test_ingress_publishes_only_the_api_over_tls():
    rendered = render("ingress-tls")
    ingress = rendered.one("Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-example-com-tls"}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    router_service = rendered.get("Service", f"{FULLNAME}-router")
    for path in rule["http"]["paths"]:
        assert path["path"] == "/v1", "/health and /metrics must stay inside the cluster"
        assert path["backend"]["service"]["name"] == router_service["metadata"]["name"]
        assert path["backend"]["service"]["port"]["name"] in {p["name"] for p in router_service["spec"]["ports"]}
    assert not render("default").of_kind("Ingress")


def test_http_route_points_at_the_router_service():
    rendered = render("gateway-k8s-discovery")
    route = rendered.one("HTTPRoute")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    service = rendered.get("Service", backend["name"])
    assert backend["port"] == service["spec"]["ports"][0]["port"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert route["spec"]["parentRefs"][0]["name"] == "public"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_pod_and_container_is_hardened(variant):
    for workload in render(variant).workloads():
        spec = pod_spec(workload)
        where = workload["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
        assert spec["securityContext"].get("runAsUser", 0) != 0
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, f"{where}/{container['name']}"
            assert sc["allowPrivilegeEscalation"] is False, f"{where}/{container['name']}"
            assert sc["capabilities"]["drop"] == ["ALL"], f"{where}/{container['name']}"
            assert not sc.get("privileged") and "add" not in sc["capabilities"]
            assert "memory" in container["resources"]["limits"], f"{where}/{container['name']}: no memory limit"


def _router_peers(rendered) -> list[dict]:
    (rule,) = rendered.get("NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"]
    return rule["from"]


def _cidrs(peers: list[dict]) -> set[str]:
    return {p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p}


@pytest.mark.parametrize("args, cidrs", [
    (("--set", "router.service.type=LoadBalancer"), {"0.0.0.0/0", "::/0"}),
    (("--set", "router.service.type=NodePort"), {"0.0.0.0/0", "::/0"}),
    # SNAT hides client IPs unless externalTrafficPolicy is Local: the source ranges apply only then.
    (("--set", "router.service.type=LoadBalancer",
      "--set", "router.service.loadBalancerSourceRanges={198.51.100.0/24}"),
     {"0.0.0.0/0", "::/0"}),
    (("--set", "router.service.type=LoadBalancer",
      "--set", "router.service.loadBalancerSourceRanges={198.51.100.0/24}",
      "--set", "router.service.externalTrafficPolicy=Local"), {"198.51.100.0/24"}),
    (("--set", "router.service.type=LoadBalancer", "--set", "networkPolicy.externalFrom[0].ipBlock.cidr=10.0.0.0/8"),
     {"10.0.0.0/8"}),
    ((), set()),
])
def test_the_router_policy_admits_the_clients_of_its_service_type(args, cidrs):
    assert _cidrs(_router_peers(render("default", *args))) == cidrs


def test_a_host_network_ingress_controller_is_admitted_by_node_cidr():
    rendered = render("ingress-tls", "--set", "networkPolicy.ingressControllerFrom[0].ipBlock.cidr=10.128.0.0/16")
    peers = _router_peers(rendered)
    assert _cidrs(peers) == {"10.128.0.0/16"}
    assert not [p for p in peers if p.get("namespaceSelector", {}).get("matchLabels") ==
                {"kubernetes.io/metadata.name": "ingress-nginx"}], "the override replaces the default peer"


def test_a_gateway_in_the_release_namespace_or_elsewhere_is_admitted():
    here = render("default", "--set", "router.httpRoute.enabled=true",
                  "--set", "router.httpRoute.parentRefs[0].name=gw")
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}} in _router_peers(here)


def test_egress_policies_allow_what_each_component_needs_and_never_the_metadata_endpoint():
    rendered = render("loadbalancer", "--set", "router.discovery=kubernetes")
    egress = {p["metadata"]["name"]: p["spec"] for p in rendered.of_kind("NetworkPolicy")
              if p["spec"]["policyTypes"] == ["Egress"]}
    assert set(egress) == {f"{FULLNAME}-router-egress", f"{FULLNAME}-replica-egress", f"{FULLNAME}-redis-egress"}
    assert egress[f"{FULLNAME}-redis-egress"]["egress"] == []

    def ports(spec):
        return {(p["port"], p["protocol"]) for rule in spec["egress"] for p in rule["ports"]}

    router, replica = egress[f"{FULLNAME}-router-egress"], egress[f"{FULLNAME}-replica-egress"]
    assert {(53, "UDP"), (53, "TCP"), (8100, "TCP"), (6379, "TCP"), (443, "TCP"), (6443, "TCP")} == ports(router)
    assert {(53, "UDP"), (53, "TCP"), (6379, "TCP")} == ports(replica)
    scheduler_rule = next(r for r in router["egress"] if r["ports"][0]["port"] == 8100)
    assert components_selected(rendered, scheduler_rule["to"][0]["podSelector"]) == {"replica"}
    for spec in (router, replica):
        for rule in spec["egress"]:
            for peer in rule["to"]:
                if "ipBlock" in peer and peer["ipBlock"]["cidr"] == "0.0.0.0/0":
                    assert "169.254.169.254/32" in peer["ipBlock"]["except"]
    assert not [p for p in render("default").of_kind("NetworkPolicy") if "Egress" in p["spec"]["policyTypes"]]


@pytest.mark.parametrize("variant", ["default", "api-keys", "ingress-tls", "external-redis"])
def test_no_secret_value_is_on_a_command_line(variant):
    """The Redis password, its URL and API keys reach processes as files or env from Secrets, never as
    arguments (which any process of the node can read in /proc/<pid>/cmdline)."""
    rendered = render(variant)
    secrets = {v for s in rendered.of_kind("Secret") for k in s["data"] for v in rendered.secret_value(
        s["metadata"]["name"], k).split()}
    assert secrets
    for workload in rendered.workloads():
        spec = pod_spec(workload)
        for container in spec["containers"] + spec.get("initContainers", []):
            words = " ".join(container.get("command", []) + container.get("args", []))
            leaked = [s for s in secrets if s in words]
            assert not leaked, f"{workload['metadata']['name']}/{container['name']} has a secret on its command line"
            for env in container.get("env", []):
                assert env.get("value", "") not in secrets, "secrets come from secretKeyRef, not literal values"


@pytest.mark.parametrize("variant, secret, key", [("default", f"{FULLNAME}-internal", "internal-token"),
                                                  ("existing-secrets", "llm-internal-token", "token")])
def test_routers_and_schedulers_share_the_internal_token_as_a_file(variant, secret, key):
    from services.commands.cli import build_parser

    rendered = render(variant)
    for component, name in (("router", "router"), ("replica", "scheduler")):
        container = rendered.container(name)
        token_file = build_parser().parse_args(container["args"]).internal_token_file
        mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod_spec(rendered.workload(component))["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == secret and mount["readOnly"] is True
        (item,) = volume["secret"]["items"]
        assert item["key"] == key and token_file.endswith("/" + item["path"])
    if variant == "default":
        assert len(rendered.secret_value(secret, key)) >= 32
    else:
        assert secret not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}
    assert "--internal-token-file" not in str(rendered.container("engine")["args"]), "the engine is loopback-only"
