"""Several base models in one release (`models:`), rendered: a replica Deployment per model with its own
selector, source, replica count, GPUs, resources and autoscaler (HPA or KEDA on that model's queue
depth), one router Service in front that is given no model, and the errors that name the entry at fault.
A release without the list renders exactly as before (the variant tests cover that)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.charts.chart_render import (
    RELEASE,
    args_of,
    containers,
    pod_labels,
    pod_spec,
    render,
    render_error,
    selector_matches,
)

FULLNAME = f"{RELEASE}-pagedserve"
TWO = ("-f", str(Path(__file__).parent / "fixtures" / "two-models-values.yaml"))


def test_each_model_gets_its_own_replicas_behind_one_router():
    rendered = render("default", *TWO)
    smol = rendered.get("Deployment", f"{FULLNAME}-replica-smol")
    keda = rendered.get("Deployment", f"{FULLNAME}-replica-smol-keda")
    assert smol["spec"]["replicas"] == 2 and "replicas" not in keda["spec"]  # KEDA owns the second's count
    for name, deployment in (("smol", smol), ("smol-keda", keda)):
        # Selectors of their own: neither Deployment adopts the other's pods.
        assert deployment["spec"]["selector"]["matchLabels"]["pagedserve.dev/model"] == name
        other = keda if deployment is smol else smol
        assert not selector_matches(deployment["spec"]["selector"], pod_labels(other))
        c = containers(deployment)
        assert args_of(c["scheduler"]).served_model_name == name
        assert args_of(c["engine"]).model == args_of(c["scheduler"]).model == "/opt/pagedserve/default-model"
    # Per-model GPUs and resources: the first on CPU with its own requests, the second on one GPU.
    cpu_engine, gpu_engine = containers(smol)["engine"], containers(keda)["engine"]
    assert args_of(cpu_engine).device == "cpu" and "nvidia.com/gpu" not in cpu_engine["resources"].get("limits", {})
    assert cpu_engine["resources"]["requests"]["cpu"] == "1"
    assert args_of(cpu_engine).kv_cache_memory == "256M"
    assert gpu_engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    # One router, one Service: it selects the routers, and the schedulers' Service every model's pods.
    router = rendered.workload("router")
    router_args = args_of(containers(router)["router"])
    assert router_args.model is None  # it learns each tokenizer from the registry
    assert "model" not in {v["name"] for v in pod_spec(router).get("volumes", [])}
    schedulers = rendered.get("Service", f"{FULLNAME}-scheduler")
    assert all(selector_matches({"matchLabels": schedulers["spec"]["selector"]}, pod_labels(d)) for d in (smol, keda))
    # A model that scales to zero makes the router hold requests while none of its replicas is ready.
    assert router_args.cold_start_timeout == 300
    # helm test asks every model.
    (hook,) = [h for h in rendered.hooks if h["kind"] == "Pod"]
    assert hook["spec"]["containers"][0]["args"][1] == "smol,smol-keda"


def test_autoscalers_scale_each_model_on_its_own_queue():
    rendered = render("default", *TWO)
    (scaled,) = rendered.of_kind("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-replica-smol-keda"
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 3)
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert 'pagedserve_router_model_queue_depth{' in query and 'model="smol-keda"' in query
    assert f'pod=~"{FULLNAME}-replica-smol-keda-[a-z0-9]+-[a-z0-9]+"' in query
    assert not rendered.of_kind("HorizontalPodAutoscaler")  # smol has none; KEDA makes its own HPA
    hpa = render("default", *TWO, "--set", "models[0].autoscaling.kind=hpa,models[0].autoscaling.maxReplicas=5")
    (h,) = hpa.of_kind("HorizontalPodAutoscaler")
    assert h["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-replica-smol" and h["spec"]["maxReplicas"] == 5
    assert "replicas" not in hpa.get("Deployment", f"{FULLNAME}-replica-smol")["spec"]


@pytest.mark.parametrize("args,needle", [
    (("--set", "models[0].name=Bad_Name"), "models/0/name"),
    (("--set", "models[0].name=a,models[0].gpuz=1"), "gpuz"),
    (("--set", "models[0].name=a,models[0].autoscaling.kind=keda"),
     "models[a].autoscaling.kind=keda needs keda.serverAddress"),
    (("--set", "models[0].name=a,models[0].autoscaling.kind=hpa,models[0].autoscaling.minReplicas=3,"
      "models[0].autoscaling.maxReplicas=2"), "models[a].autoscaling.minReplicas (3) must not exceed"),
    (("--set", "models[0].name=a,models[0].source=pvc"), "claimName"),
])
def test_bad_model_entries_are_refused_by_name(args, needle):
    assert needle in render_error(*args)
