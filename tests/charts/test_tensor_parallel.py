"""Tensor parallelism in the chart: `replica.engine.gpus: N` starts one engine of N ranks in its
container (N GPUs, a memory-backed /dev/shm); `replica.nodes: M` renders a LeaderWorkerSet whose
leader runs rank 0 beside the scheduler and whose workers run `pagedserve engine-worker` with the
same engine flags, meeting at the leader's rendezvous; it is rendered only then, validated against
the pinned LeaderWorkerSet schema, scaled by the autoscaler and fenced by NetworkPolicies."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from services.commands.cli import build_parser
from services.engine.config import EngineConfig
from tests.charts import lws_schema
from tests.charts.chart_render import RELEASE, VARIANTS, pod_labels, pod_spec, render, selector_matches

FULLNAME = f"{RELEASE}-pagedserve"


def config_of(container: dict, env: dict | None = None, monkeypatch=None) -> tuple[EngineConfig, object]:
    if monkeypatch is not None:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args(container["args"])
    return EngineConfig.from_args(args), args


def _volume(workload: dict, name: str) -> dict:
    return next(v for v in pod_spec(workload)["volumes"] if v["name"] == name)


def test_several_gpus_start_one_engine_of_that_many_ranks_in_its_container():
    rendered = render("tensor-parallel")
    assert not rendered.of_kind("LeaderWorkerSet"), "one node: a Deployment, no LeaderWorkerSet"
    engine = rendered.container("engine")
    config, _ = config_of(engine)
    assert (config.tensor_parallel_size, config.ranks_per_machine, config.tp_rendezvous) == (3, 3, None)
    assert config.tp_timeout == 120 and config.device == "cuda"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == engine["resources"]["requests"]["nvidia.com/gpu"] == 3
    replica = rendered.workload("replica")
    assert _volume(replica, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    # The scheduler knows nothing of the split.
    scheduler = build_parser().parse_args(rendered.container("scheduler")["args"])
    assert not hasattr(scheduler, "tensor_parallel_size")


def test_one_gpu_passes_no_tensor_parallel_flag():
    for variant in ("default", "gpu", "cpu"):
        assert not any(a.startswith("--tensor-parallel") or a.startswith("--tp-")
                       for a in render(variant).container("engine")["args"])


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "multinode"])
def test_a_leader_worker_set_is_rendered_only_for_replicas_spanning_nodes(variant):
    rendered = render(variant)
    assert not rendered.of_kind("LeaderWorkerSet")
    assert rendered.get("Deployment", f"{FULLNAME}-replica")


def test_replicas_spanning_nodes_are_leader_worker_set_groups(monkeypatch):
    rendered = render("multinode")
    assert not [d for d in rendered.of_kind("Deployment") if d["metadata"]["name"] == f"{FULLNAME}-replica"]
    lws = rendered.get("LeaderWorkerSet", f"{FULLNAME}-replica")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated" and "replicas" not in lws["spec"]  # the HPA's
    leader, worker = rendered.workload("replica"), rendered.workload("replica-worker")
    assert [c["name"] for c in pod_spec(leader)["containers"]] == ["engine", "scheduler"]
    (worker_container,) = pod_spec(worker)["containers"]
    assert worker_container["name"] == "engine-worker"
    assert not {k for k in worker_container if k.endswith("Probe")}, "its group's timeouts watch it, not a probe"

    rank0, rank0_args = config_of(rendered.container("engine"))
    assert (rank0.tensor_parallel_size, rank0.ranks_per_machine) == (16, 8)
    assert rank0.tp_rendezvous == "tcp://$(LWS_LEADER_ADDRESS):29500"
    assert rank0_args.command == "engine" and rank0_args.host == "127.0.0.1"
    rendezvous = next(p for p in rendered.container("engine")["ports"] if p["name"] == "tp-rendezvous")
    assert rendezvous["containerPort"] == 29500
    # The worker's node rank is its pod's worker index (the leader is 0): ranks 8..15 on worker 1.
    node_rank = next(e for e in worker_container["env"] if e["name"] == "PAGEDSERVE_TP_NODE_RANK")
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']")
    workers, worker_args = config_of(worker_container, {"PAGEDSERVE_TP_NODE_RANK": "1"}, monkeypatch)
    assert worker_args.command == "engine-worker" and worker_args.tp_node_rank == 1
    # Every rank gets the engine's own flags: what rank 0 checks at start-up agrees by construction.
    assert workers == rank0
    for pod in (leader, worker):
        container = pod_spec(pod)["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert _volume(pod, "dshm")["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    # Routers, Services and monitors see the leaders (schedulers) only.
    scheduler_service = rendered.get("Service", f"{FULLNAME}-scheduler")
    assert selector_matches({"matchLabels": scheduler_service["spec"]["selector"]}, pod_labels(leader))
    assert not selector_matches({"matchLabels": scheduler_service["spec"]["selector"]}, pod_labels(worker))


def test_the_autoscaler_scales_the_groups():
    (hpa,) = [h for h in render("multinode").of_kind("HorizontalPodAutoscaler")
              if h["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-replica"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    # The pinned CRD has the scale subresource the HPA needs.
    assert lws_schema.pinned()["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    keda = render("multinode", "--set", "keda.enabled=true", "--set", "keda.serverAddress=http://prom:9090",
                  "--set", "autoscaling.enabled=false").one("ScaledObject")
    assert keda["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                              "kind": "LeaderWorkerSet", "name": f"{FULLNAME}-replica"}


def test_egress_lets_the_ranks_of_a_group_reach_each_other():
    policies = {p["metadata"]["name"]: p for p in render("multinode").of_kind("NetworkPolicy")}
    replica = policies[f"{FULLNAME}-replica-egress"]["spec"]["egress"]
    worker = policies[f"{FULLNAME}-replica-worker-egress"]["spec"]["egress"]
    to_workers = [r for r in replica if "ports" not in r]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in to_workers
            for p in r["to"]] == ["replica-worker"]
    ranks = [r for r in worker if "ports" not in r]
    assert sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in ranks
                  for p in r["to"]) == ["replica", "replica-worker"]
    assert any({"port": 53, "protocol": "UDP"} in r.get("ports", []) for r in worker), "the leader's DNS name"


def test_the_pinned_schema_refuses_what_the_api_server_would():
    lws = render("multinode").get("LeaderWorkerSet", f"{FULLNAME}-replica")
    lws_schema.validate(lws)
    broken = []
    for path, value in ((("spec", "leaderWorkerTemplate", "restartPolicy"), "Always"),
                        (("spec", "leaderWorkerTemplate", "size"), "two"),
                        (("spec", "startupPolicy"), "WorkersFirst"),
                        (("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "gpus"), 8)):
        obj = copy.deepcopy(lws)
        node = obj
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            lws_schema.validate(obj)
        broken.append(path[-1])
    assert len(broken) == 4
