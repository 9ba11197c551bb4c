"""What users of other charts expect, rendered and checked: extra env, volumes and objects, labels and
annotations, probe and security overrides, one ServiceAccount for the release, router autoscaling,
KEDA fallback and idle replicas, Valkey, GGUF conversion in init containers, the cold-start hold when
replicas scale to zero, and the chart README that documents every value."""

from __future__ import annotations

import pytest
import yaml

from services.contracts import metric_names as M
from tests.charts import values_doc
from tests.charts.chart_render import NAMESPACE, RELEASE, args_of, pod_labels, pod_spec, render, render_error

FULLNAME = f"{RELEASE}-pagedserve"


def test_extra_env_volumes_and_objects_reach_the_pods():
    rendered = render("loadbalancer")
    router = rendered.container("router")
    assert {"name": "HTTPS_PROXY", "value": "http://proxy.example.internal:3128"} in router["env"]
    assert {"name": "ca-bundle", "mountPath": "/etc/ssl/custom", "readOnly": True} in router["volumeMounts"]
    volumes = {v["name"]: v for v in pod_spec(rendered.workload("router"))["volumes"]}
    assert volumes["ca-bundle"]["configMap"] == {"name": "llm-ca-bundle"}
    # extraObjects pass through tpl: the ConfigMap lands in the release's namespace.
    config_map = rendered.get("ConfigMap", "llm-ca-bundle")
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in rendered.container("engine")["env"]


def test_extra_objects_may_be_strings():
    rendered = render("default", "--set-string",
                      "extraObjects[0]=apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-x")
    assert rendered.get("ConfigMap", f"{RELEASE}-x")


def test_pod_labels_annotations_and_security_overrides():
    rendered = render("loadbalancer")
    router = rendered.workload("router")
    assert pod_labels(router)["team"] == "ml-platform" and pod_labels(rendered.workload("redis"))["team"]
    assert router["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    security = rendered.container("router")["securityContext"]
    assert security["runAsUser"] == 10002, "the component's override"
    assert security["capabilities"] == {"drop": ["ALL"]} and security["readOnlyRootFilesystem"] is True
    assert "runAsUser" not in rendered.container("scheduler")["securityContext"]


def test_probe_overrides_merge_over_the_charts_probes():
    rendered = render("loadbalancer")
    liveness = rendered.container("router")["livenessProbe"]
    assert liveness["periodSeconds"] == 30 and liveness["httpGet"]["path"] == "/health"
    engine = rendered.container("engine")["livenessProbe"]
    assert engine["failureThreshold"] == 9 and engine["terminationGracePeriodSeconds"] == 10
    fast = render("default", "--set", "replica.engine.probes.liveness.timeoutSeconds=2").container("engine")
    command = fast["livenessProbe"]["exec"]["command"]
    assert args_of({"args": command[1:]}).timeout == 1, "the probe's own timeout follows the kubelet's"


def test_one_service_account_for_the_release():
    rendered = render("loadbalancer")
    (account,) = rendered.of_kind("ServiceAccount")
    assert account["metadata"]["name"] == "llm-serving"
    for workload in rendered.workloads():
        if pod_labels(workload)["app.kubernetes.io/component"] != "test":
            assert pod_spec(workload)["serviceAccountName"] == "llm-serving"
    discovery = render("default", "--set", "serviceAccount.name=llm-serving", "--set", "router.discovery=kubernetes")
    (binding,) = discovery.of_kind("RoleBinding")
    assert binding["subjects"][0]["name"] == "llm-serving"


def test_router_autoscaler_on_cpu_and_request_rate():
    rendered = render("loadbalancer")
    hpa = rendered.get("HorizontalPodAutoscaler", f"{FULLNAME}-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-router"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 60}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "pagedserve_router_requests_per_second"
    assert "replicas" not in rendered.get("Deployment", f"{FULLNAME}-router")["spec"]
    err = render_error("--set", "router.autoscaling.enabled=true", "--set",
                       "router.autoscaling.targetCPUUtilizationPercentage=null")
    assert "needs router.autoscaling.targetCPUUtilizationPercentage or targetRequestsPerSecond" in err


def test_keda_fallback_and_idle_replicas():
    base = ("--set", "keda.enabled=true", "--set", "keda.serverAddress=http://prom:9090")
    scaled = render("default", *base, "--set", "keda.fallback.replicas=2", "--set", "keda.idleReplicaCount=0",
                    "--set", "autoscaling.minReplicas=1").one("ScaledObject")
    assert scaled["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 2}
    assert scaled["spec"]["idleReplicaCount"] == 0 and scaled["spec"]["minReplicaCount"] == 1
    plain = render("default", *base).one("ScaledObject")
    assert "fallback" not in plain["spec"] and "idleReplicaCount" not in plain["spec"]
    err = render_error(*base, "--set", "keda.idleReplicaCount=0", "--set", "autoscaling.minReplicas=0")
    assert "keda.idleReplicaCount (0) must be below autoscaling.minReplicas (0)" in err


@pytest.mark.parametrize("args, timeout", [
    ((), None),                                                                 # replicas never scale to zero
    (("-f", "k8s/keda/values.yaml"), 300.0),                                    # KEDA, minReplicas 0
    (("--set", "keda.enabled=true", "--set", "keda.serverAddress=http://p:9090", "--set", "autoscaling.minReplicas=1",
      "--set", "keda.idleReplicaCount=0"), 300.0),                              # idle to zero
    (("-f", "k8s/keda/values.yaml", "--set", "router.coldStartTimeoutSeconds=900"), 900.0),
    (("--set", "router.coldStartTimeoutSeconds=30"), 30.0),
])
def test_routers_hold_requests_when_replicas_can_scale_to_zero(args, timeout):
    router = args_of(render("default", *args).container("router"))
    assert router.cold_start_timeout == (timeout or 0.0)


def test_keda_scales_from_zero_on_held_requests():
    scaled = render("keda").one("ScaledObject")
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert f"sum({M.ROUTER_REQUESTS_HELD}{{" in query, "held requests are the scale-from-zero signal"
    assert "increase(" not in query, "a counter created at the first refusal never shows its first increase"
    assert M.ROUTER_REQUESTS_HELD in M.ROUTER_METRICS


def test_valkey_instead_of_redis():
    rendered = render("loadbalancer")
    (container,) = pod_spec(rendered.workload("redis"))["containers"]
    assert container["image"].startswith("docker.io/valkey/valkey:")
    assert "exec valkey-server - " in container["args"][0]
    assert "valkey-cli" in container["readinessProbe"]["exec"]["command"][2]
    assert "VALKEYCLI_AUTH" in {e["name"] for e in container["env"]}
    default = pod_spec(render("default").workload("redis"))["containers"][0]
    assert default["image"].startswith("docker.io/library/redis:") and "REDISCLI_AUTH" in str(default["env"])


def test_a_gguf_model_is_converted_once_per_pod_and_only_the_engine_sees_weights():
    rendered = render("gguf-pvc")
    replica, router_pod = pod_spec(rendered.workload("replica")), pod_spec(rendered.workload("router"))
    (convert,) = replica["initContainers"]
    (extract,) = router_pod["initContainers"]
    for init in (convert, extract):
        assert init["image"] == rendered.container("engine")["image"], "only the engine image has torch"
        assert init["command"] == ["pagedserve"] and args_of(init).command == "convert"
    assert args_of(convert).model == "/models/gguf/Qwen2.5-1.5B-Instruct-Q4_K_M.gguf"
    assert args_of(extract).tokenizer_only and not args_of(convert).tokenizer_only
    # The router and the scheduler never mount the model volume: they read the converted tokenizer and
    # config only. The engine reads the converted weights.
    for name in ("router", "scheduler"):
        mounts = {m["name"] for m in rendered.container(name)["volumeMounts"]}
        assert "model" not in mounts and "converted" in mounts
    assert args_of(rendered.container("scheduler")).model == args_of(rendered.container("engine")).model
    converted = {v["name"]: v for v in replica["volumes"]}["converted"]
    assert converted["emptyDir"]["sizeLimit"] == "16Gi"
    engine = rendered.container("engine")
    assert engine["resources"]["requests"]["ephemeral-storage"] == "16Gi"
    assert "nvidia.com/gpu" not in convert["resources"].get("limits", {}), "conversion needs no GPU"
    assert not render("gpu").workload("replica")["spec"]["template"]["spec"].get("initContainers")


def test_engine_requests_ephemeral_storage_for_its_volumes():
    engine = render("default").container("engine")
    assert engine["resources"]["requests"]["ephemeral-storage"] == "4Gi"
    mine = render("default", "--set", "replica.engine.resources.requests.ephemeral-storage=9Gi").container("engine")
    assert mine["resources"]["requests"]["ephemeral-storage"] == "9Gi"


def test_the_chart_readme_documents_every_value():
    readme = values_doc.README.read_text()
    assert values_doc.current_section(readme) == values_doc.section(), \
        "charts/pagedserve/README.md's values table is stale: run `make chart-readme`"
    table = values_doc.table()
    values = yaml.safe_load((values_doc.CHART / "values.yaml").read_text())
    for path, _ in values_doc.leaves(values):
        assert f"| `{path}` |" in table
