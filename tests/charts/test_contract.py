"""The chart runs the services the way the services define themselves (services/commands/settings.py,
services/commands/cli.py): every container command is a real `pagedserve` subcommand whose flags parse,
every env var is one a service reads, probes hit the ports and paths the services serve, and the values
shared by several services (model, ports, limits) agree."""

from __future__ import annotations

import argparse
import re

import pytest
import yaml

from services.commands import settings
from services.commands.cli import build_parser
from services.openai_api.server import LIVENESS_PATH
from tests.charts.chart_render import VARIANTS, pod_spec, render

# Kubernetes expands $(NAME) in env values and args from earlier variables of the same container.
_EXPANSION = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# The health endpoint every HTTP service serves (200 when ready, 503 otherwise).
HEALTH_PATH = "/health"
# Read by the container runtime, not by a service: NVIDIA's runtime exposes the GPUs it names; and by
# the libraries under the engine's tensor-parallel ranks (torch.distributed's gloo, NCCL).
RUNTIME_ENV_VARS = {"NVIDIA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}
# Set in every container of a LeaderWorkerSet's pods by its controller (so $(...) may refer to them).
LWS_ENV_VARS = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}


def parse(container: dict) -> argparse.Namespace:
    """The container's args through the real `pagedserve` parser; argparse errors become test failures."""
    assert container["command"] == ["pagedserve"], f"{container['name']}: command {container['command']}"
    try:
        return build_parser().parse_args(container["args"])
    except SystemExit as exc:
        raise AssertionError(f"{container['name']}: `pagedserve {' '.join(container['args'])}` "
                             f"does not parse (exit {exc.code})") from None


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    assert numbers, f"{container['name']}: no container port named {port!r}"
    return numbers[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_container_command_is_a_real_subcommand_with_valid_flags(variant):
    rendered = render(variant)
    containers = rendered.pagedserve_containers()
    # A replica spanning nodes also has worker pods, whose engine container runs the other ranks.
    workers = {"engine-worker"} if rendered.of_kind("LeaderWorkerSet") else set()
    assert {c["name"] for _, c in containers} == {"router", "engine", "scheduler"} | workers
    for _, container in containers:
        args = parse(container)
        assert args.command == container["name"], f"container {container['name']} runs `{args.command}`"


def _user_env(variant: str) -> set[str]:
    """Env var names the variant's values add through extraEnv (the user's own, not the chart's)."""
    path = VARIANTS[variant]
    values = yaml.safe_load(path.read_text()) if path else {}
    lists = [values.get("router", {}).get("extraEnv")]
    lists += [values.get("replica", {}).get(c, {}).get("extraEnv") for c in ("engine", "scheduler")]
    return {e["name"] for env in lists if env for e in env}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_env_var_is_read_by_the_services(variant):
    known = settings.all_env_vars() | _user_env(variant)
    for workload, container in render(variant).pagedserve_containers():
        injected = LWS_ENV_VARS if workload["kind"] == "LeaderWorkerSet" else set()
        env = container.get("env", [])
        names = [e["name"] for e in env]
        referenced = {ref for e in env for ref in _EXPANSION.findall(e.get("value", ""))}
        referenced |= {ref for arg in container["args"] for ref in _EXPANSION.findall(arg)}
        for name in names:
            if name in known or name in RUNTIME_ENV_VARS:
                continue
            # Allowed only as an input to Kubernetes' own $(NAME) expansion, never as a service setting.
            assert not name.startswith("PAGEDSERVE_"), f"{container['name']}: {name} is no setting of any service"
            assert name in referenced, f"{container['name']}: sets {name}, which no service reads"
        for ref in referenced:
            assert ref in names or ref in injected, f"{container['name']}: $({ref}) refers to an unset variable"
        assert len(names) == len(set(names)), f"{container['name']}: duplicate env vars {names}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_env_vars_and_flags_do_not_set_the_same_option_twice(variant):
    for _, container in render(variant).pagedserve_containers():
        flags = {a.split("=", 1)[0] for a in container["args"] if a.startswith("--")}
        for e in container.get("env", []):
            for opt in (*settings.ENGINE_OPTIONS, *settings.SCHEDULER_OPTIONS, *settings.ROUTER_OPTIONS):
                if opt.env == e["name"]:
                    assert opt.flag not in flags, f"{container['name']}: {opt.flag} given as flag and env var"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_probes_hit_the_ports_and_paths_the_services_serve(variant):
    rendered = render(variant)
    # The router's /health answers while its loop runs (it is healthy without replicas).
    router = rendered.container("router")
    scheduler = rendered.container("scheduler")
    paths = {("router", kind): HEALTH_PATH for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    # The scheduler: alive is its own event loop, ready is the chain (engine loaded and answering).
    paths |= {("scheduler", "startupProbe"): LIVENESS_PATH, ("scheduler", "livenessProbe"): LIVENESS_PATH,
              ("scheduler", "readinessProbe"): HEALTH_PATH}
    for name, container in (("router", router), ("scheduler", scheduler)):
        args = parse(container)
        assert args.host == "0.0.0.0"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]["httpGet"]
            assert probe["path"] == paths[name, kind], f"{name} {kind} path {probe['path']}"
            assert port_number(container, probe["port"]) == args.port, f"{name} {kind} port"
        assert port_number(container, "http") == args.port == settings.DEFAULT_PORTS[name]
    # The engine speaks ZeroMQ on loopback: exec probes make a health round trip to its --port there.
    engine = rendered.container("engine")
    args = parse(engine)
    assert args.host == "127.0.0.1", "the engine must listen on loopback only"
    assert args.port == settings.DEFAULT_PORTS["engine"] == port_number(engine, "engine")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = engine[kind]
        command = probe["exec"]["command"]
        assert command[0] == "pagedserve", command
        probe_args = build_parser().parse_args(command[1:])
        assert (probe_args.command, probe_args.probe_target) == ("probe", "engine")
        assert probe_args.engine == f"tcp://127.0.0.1:{args.port}", f"engine {kind} checks the wrong address"
        assert probe_args.timeout < probe["timeoutSeconds"], "the probe must answer before the kubelet gives up"
    # A hung engine's preStop would wait for its (still connected) scheduler: liveness kills it fast.
    liveness = engine["livenessProbe"]
    assert liveness["terminationGracePeriodSeconds"] <= 15
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60, "a long step must not look hung"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_shared_values_agree_across_services(variant):
    rendered = render(variant)
    router, scheduler, engine = (parse(rendered.container(n)) for n in ("router", "scheduler", "engine"))
    # Routers learn block size, hash seed and served name from the registry; they only share the model
    # files (for the tokenizer), and have no flag of their own that could disagree with the engine.
    assert not hasattr(router, "block_size") and not hasattr(router, "served_model_name")
    assert scheduler.model == engine.model
    converters = {c["name"]: build_parser().parse_args(c["args"]) for w in rendered.workloads()
                  for c in pod_spec(w).get("initContainers", [])}
    if converters:  # a GGUF model: all read the one source, through their pod's conversion
        model, tokenizer = converters["convert-model"], converters["extract-tokenizer"]
        assert model.model == tokenizer.model and model.model.endswith(".gguf")
        assert (model.output, tokenizer.output) == (engine.model, router.model)
        assert tokenizer.tokenizer_only and not model.tokenizer_only
    else:
        assert router.model == engine.model
    assert scheduler.max_model_len == engine.max_model_len
    assert scheduler.max_num_seqs == engine.max_num_seqs  # the engine's CUDA graphs cover its largest batch
    assert scheduler.engine == f"tcp://127.0.0.1:{engine.port}"
    assert scheduler.max_body_bytes == router.max_body_bytes
    for name in ("router", "scheduler", "engine"):
        assert parse(rendered.container(name)).log_level == router.log_level


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_count_decides_device_and_resources(variant):
    rendered = render(variant)
    engine = rendered.container("engine")
    device = parse(engine).device
    resources = engine["resources"]
    gpu_keys = {k for part in resources.values() for k in part if "/" in k}
    spec = pod_spec(rendered.workload("replica"))
    if device == "cuda":
        assert len(gpu_keys) == 1, gpu_keys
        key = gpu_keys.pop()
        assert resources["limits"][key] == resources["requests"][key] >= 1
        # The GPU operator's taint is nvidia.com/gpu whatever resource is requested (MIG included).
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in engine["env"]}, "the device plugin sets it"
    else:
        assert device == "cpu" and not gpu_keys, "a CPU replica must not request a GPU"
        assert not any("gpu" in str(t.get("key")) for t in spec.get("tolerations", []))
        # The engine image says NVIDIA_VISIBLE_DEVICES=all; a CPU replica must not get every GPU of the node.
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    for _, container in rendered.pagedserve_containers():
        if container["name"] not in ("engine", "engine-worker"):
            assert not any("/" in k for part in container["resources"].values() for k in part)


def test_cpu_and_gpu_variants_pick_their_device():
    assert parse(render("cpu").container("engine")).device == "cpu"
    assert parse(render("gpu").container("engine")).device == "cuda"
    assert render("gpu").container("engine")["resources"]["limits"]["nvidia.com/gpu"] == 1
    mig = render("gateway-k8s-discovery").container("engine")["resources"]["limits"]
    assert mig["nvidia.com/mig-1g.10gb"] == 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_writable_paths_are_volumes_on_read_only_root_filesystems(variant):
    for workload, container in render(variant).pagedserve_containers():
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod_spec(workload).get("volumes", [])}
        assert {m["name"] for m in mounts.values()} <= volumes
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("PAGEDSERVE_CACHE_DIR") in mounts, f"{container['name']}: cache dir is not a volume"
        assert "/tmp" in mounts
        model = parse(container).model
        if not model.startswith("/opt/pagedserve/"):  # not the model baked into the images
            assert any(model.startswith(path) and m["readOnly"] for path, m in mounts.items()), \
                f"{container['name']}: --model {model} is not on a read-only volume mount"


def test_model_sources_mount_the_same_volume_everywhere():
    gpu = render("gpu")
    for _, container in gpu.pagedserve_containers():
        assert parse(container).model == "/models/meta-llama/Llama-3.1-8B-Instruct"
    for component in ("router", "replica"):
        volumes = {v["name"]: v for v in pod_spec(gpu.workload(component))["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models-rox", "readOnly": True}
    host = render("gateway-k8s-discovery")
    assert not hasattr(parse(host.container("engine")), "served_model_name")  # the engine serves no API
    assert parse(host.container("scheduler")).served_model_name == "Qwen2.5-0.5B-Instruct"
    volumes = {v["name"]: v for v in pod_spec(host.workload("replica"))["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/var/lib/models"
    default = render("default")
    assert parse(default.container("scheduler")).served_model_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_graceful_termination_leaves_time_to_drain(variant):
    rendered = render(variant)
    router_spec = pod_spec(rendered.workload("router"))
    router = rendered.container("router")
    assert (router["lifecycle"]["preStop"]["sleep"]["seconds"] + parse(router).drain_timeout
            < router_spec["terminationGracePeriodSeconds"])
    replica_spec = pod_spec(rendered.workload("replica"))
    scheduler = rendered.container("scheduler")
    grace = replica_spec["terminationGracePeriodSeconds"]
    assert scheduler["lifecycle"]["preStop"]["sleep"]["seconds"] + parse(scheduler).drain_timeout < grace
    engine = rendered.container("engine")
    command = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "pagedserve"
    wait = build_parser().parse_args(command[1:])
    assert wait.command == "wait-for-disconnect"
    assert parse(scheduler).drain_timeout < wait.timeout < grace
    assert wait.engine == f"tcp://127.0.0.1:{parse(engine).port}", "it must watch the engine's own address"


def test_kubernetes_discovery_names_the_schedulers_headless_service():
    rendered = render("gateway-k8s-discovery")
    args = parse(rendered.container("router"))
    assert args.discovery == "kubernetes"
    service = rendered.get("Service", args.k8s_service)
    assert service["spec"]["clusterIP"] == "None"
    assert args.k8s_namespace == service["metadata"]["namespace"]
    assert pod_spec(rendered.workload("router"))["automountServiceAccountToken"] is True
    assert parse(render("default").container("router")).discovery == "redis"
    assert pod_spec(render("default").workload("router"))["automountServiceAccountToken"] is False


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_schedulers_advertise_their_pod_ip_and_port(variant):
    scheduler = render(variant).container("scheduler")
    env = {e["name"]: e for e in scheduler["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PAGEDSERVE_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{parse(scheduler).port}"
    # Kubernetes only expands variables defined earlier in the list.
    names = [e["name"] for e in scheduler["env"]]
    assert names.index("POD_IP") < names.index("PAGEDSERVE_ADVERTISE_URL")


def test_api_keys_reach_the_router_as_a_file_from_a_secret():
    rendered = render("api-keys")
    router = rendered.container("router")
    keys_file = parse(router).api_keys_file
    mount = next(m for m in router["volumeMounts"] if keys_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod_spec(rendered.workload("router"))["volumes"] if v["name"] == mount["name"])
    item = volume["secret"]["items"][0]
    assert keys_file.endswith("/" + item["path"])
    keys = rendered.secret_value(volume["secret"]["secretName"], item["key"]).split()
    assert keys == ["sk-team-a-0123456789", "sk-team-b-9876543210"]
    existing = render("existing-secrets")
    volume = next(v for v in pod_spec(existing.workload("router"))["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "llm-api-keys" and volume["secret"]["items"][0]["key"] == "keys.txt"
    assert not [s for s in existing.of_kind("Secret") if s["metadata"]["name"] == "llm-api-keys"]
    generated = render("ingress-tls")
    name = pod_spec(generated.workload("router"))["volumes"][-1]["secret"]["secretName"]
    assert re.fullmatch(r"sk-[A-Za-z0-9]{40}", generated.secret_value(name, "api-keys").strip())
    assert parse(render("default").container("router")).api_keys_file is None
