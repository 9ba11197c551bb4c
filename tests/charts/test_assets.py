"""What lives beside the chart: the Prometheus adapter rules, the Grafana dashboard and the KEDA example
name metrics the services really export (services/contracts/metric_names.py); the Dockerfiles build the images the
chart runs (non-root, the uid and paths the chart assumes); `make images` builds all three."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from services.contracts import metric_names as M
from tests.charts.chart_render import CHART, REPO, helm, parse_documents

_METRIC = re.compile(r"\bpagedserve_[a-z0-9_]+\b")
K8S = REPO / "k8s"
DOCKER = REPO / "docker"
SERVICES = ("router", "scheduler", "engine")


def _chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_adapter_rules_expose_the_metric_the_hpa_reads():
    values = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    rules = values["rules"]["custom"]
    exposed = {}
    for rule in rules:
        (series,) = set(_METRIC.findall(rule["seriesQuery"]))
        assert series in M.ALL_METRICS, f"{series} is not a metric the services export"
        assert re.fullmatch(rule["name"]["matches"], series)
        exposed[rule["name"]["as"]] = rule
        # Per-pod metrics: the series' namespace and pod labels map to Kubernetes objects.
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
    assert M.AUTOSCALING_METRIC in exposed
    hpa = next(o for o in parse_documents(helm("template", "llm", str(CHART), "--set", "autoscaling.enabled=true",
                                              check=True).stdout) if o["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in exposed
    # The routers' HPA on requests per second reads a rate of the routers' request counter.
    router_hpa = next(o for o in parse_documents(helm(
        "template", "llm", str(CHART), "--set", "router.autoscaling.enabled=true",
        "--set", "router.autoscaling.targetRequestsPerSecond=20", check=True).stdout)
        if o["kind"] == "HorizontalPodAutoscaler" and o["metadata"]["name"].endswith("-router"))
    pods_metric = next(m for m in router_hpa["spec"]["metrics"] if m["type"] == "Pods")
    rule = exposed[pods_metric["pods"]["metric"]["name"]]
    assert M.ROUTER_REQUESTS in rule["seriesQuery"] and "rate(<<.Series>>" in rule["metricsQuery"]


def _dashboard_exprs(dashboard: dict) -> dict[str, list[str]]:
    exprs: dict[str, list[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.setdefault(panel["title"], []).append(target["expr"])
    return exprs


def test_dashboard_only_names_exported_metrics():
    dashboard = json.loads((K8S / "grafana" / "pagedserve-dashboard.json").read_text())
    exprs = _dashboard_exprs(dashboard)
    used = {name for panel in exprs.values() for e in panel for name in _METRIC.findall(e)}
    unknown = used - M.exported_series_names()
    assert not unknown, f"the dashboard queries metrics no service exports: {sorted(unknown)}"
    for variable in dashboard["templating"]["list"]:
        assert set(_METRIC.findall(json.dumps(variable))) <= M.exported_series_names()


@pytest.mark.parametrize("topic, needles", [
    ("queue depth", [M.REQUESTS_WAITING, M.ROUTER_QUEUE_DEPTH]),
    ("running", [M.REQUESTS_RUNNING]),
    ("KV usage", [M.KV_CACHE_USAGE_RATIO]),
    ("prefix hit rate", [M.PREFIX_CACHE_HITS, M.PREFIX_CACHE_QUERIES]),
    ("TTFT percentiles", [f"histogram_quantile(0.99, sum by (le) (rate({M.TIME_TO_FIRST_TOKEN}_bucket"]),
    ("inter-token latency percentiles", [f"histogram_quantile(0.99, sum by (le) (rate({M.INTER_TOKEN_LATENCY}_bucket"]),
    ("tokens/s", [f"rate({M.GENERATION_TOKENS}", f"rate({M.PROMPT_TOKENS}"]),
    ("routing decisions", [M.ROUTER_ROUTING_DECISIONS]),
    ("errors", [M.ROUTER_UPSTREAM_ERRORS, 'status=~"5.."']),
])
def test_dashboard_covers(topic, needles):
    text = "\n".join(e for panel in _dashboard_exprs(json.loads(
        (K8S / "grafana" / "pagedserve-dashboard.json").read_text())).values() for e in panel)
    for needle in needles:
        assert needle in text, f"no panel shows {topic} ({needle})"


def test_dashboard_is_loadable_by_the_grafana_sidecar():
    kustomization = yaml.safe_load((K8S / "grafana" / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    for name in generator["files"]:
        assert (K8S / "grafana" / name).exists()
    assert generator["options"]["labels"] == {"grafana_dashboard": "1"}
    dashboard = json.loads((K8S / "grafana" / "pagedserve-dashboard.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]


def test_keda_example_renders_a_scaled_object_on_exported_metrics():
    values = K8S / "keda" / "values.yaml"
    objects = parse_documents(helm("template", "llm", str(CHART), "-n", "serving", "-f", str(values),
                                   check=True).stdout)
    kinds = [o["kind"] for o in objects]
    assert "ScaledObject" in kinds and "HorizontalPodAutoscaler" not in kinds
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert set(_METRIC.findall(query)) <= M.exported_series_names()
    # The README shows the query the chart really renders for this example.
    readme = (K8S / "keda" / "README.md").read_text()
    for term in re.findall(r"\(sum\(.*?\) or vector\(0\)\)", query):
        assert term in readme, f"k8s/keda/README.md does not show {term}"
    auth = parse_documents((K8S / "keda" / "triggerauthentication.yaml").read_text())
    assert [o["kind"] for o in auth] == ["Secret", "TriggerAuthentication"]
    assert auth[1]["spec"]["secretTargetRef"][0]["name"] == auth[0]["metadata"]["name"]


def test_metric_names_module_is_consistent():
    assert M.ALL_METRICS == M.SCHEDULER_METRICS | M.ROUTER_METRICS
    assert M.HISTOGRAMS <= M.ALL_METRICS
    for name in M.ALL_METRICS:
        assert re.fullmatch(r"pagedserve_[a-z0-9_]+", name)
        if name.endswith("_total"):
            assert name not in M.HISTOGRAMS


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_runs_non_root_with_the_cache_on_a_volume(service):
    text = (DOCKER / f"{service}.Dockerfile").read_text()
    final_stage = text[text.rindex("\nFROM "):]
    uid = _chart_values()["podSecurityContext"]["runAsUser"]
    assert re.search(rf"^USER {uid}:{uid}$", final_stage, re.M), "numeric non-root USER, the chart's uid"
    assert 'VOLUME ["/cache"]' in final_stage
    assert re.search(r"PAGEDSERVE_CACHE_DIR=/cache\b", final_stage)
    assert 'ENTRYPOINT ["pagedserve"]' in final_stage
    # The chart passes this path as --model for the bundled model.
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    bundled = re.search(r'define "pagedserve.bundledModelPath" -}}(\S+?){{', helpers).group(1)
    assert f" {bundled}\n" in final_stage, f"{service} image lacks the bundled model at {bundled}"
    ignore = (DOCKER / f"{service}.Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*"):][:1] == ["*"] and "!services/" in ignore


def test_images_use_the_bases_the_services_need():
    router, scheduler, engine = ((DOCKER / f"{s}.Dockerfile").read_text() for s in SERVICES)
    for text in (router, scheduler):
        assert "ARG PYTHON_IMAGE=python:3.11-slim" in text and "/whl/cpu" in text
    assert "ARG CUDA_IMAGE=nvidia/cuda:" in engine and "-runtime-" in engine
    assert '"/src[engine]"' in engine and '"/src[triton]"' in engine, \
        "the engine image carries torch and the model formats, and Triton in its CUDA variant"
    assert "gcc" in engine, "Triton compiles its launcher with the system C compiler at run time"
    # The CPU variant: the CPU torch, kernels compiled at build time and found at start.
    assert "ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu" in engine
    assert "--prebuild /opt/pagedserve/kernels" in engine
    assert "PAGEDSERVE_KERNEL_PREBUILT=/opt/pagedserve/kernels" in engine


def test_make_images_builds_the_three_images_with_the_charts_tag():
    result = subprocess.run(["make", "-n", "images"], cwd=REPO, capture_output=True, text=True, check=True)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    version = re.search(r'^version = "(.+)"', pyproject, re.M).group(1)
    assert chart["appVersion"] == version, "the chart's default image tag must be the package version"
    assert "make/images.py build --targets router,scheduler,engine-cpu,engine" in result.stdout
    assert f"--prefix pagedserve --tag {version}" in result.stdout
    images = _chart_values()["images"]
    for service in SERVICES:
        assert images[service]["repository"] == f"pagedserve/{service}"
    # CPU replicas run the CPU engine image, built beside the CUDA one.
    cpu = yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text())
    assert cpu["images"]["engine"]["repository"] == "pagedserve/engine-cpu"


def _exposed_series(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_the_services_metrics_endpoints_export_every_name_the_cluster_side_uses():
    """What /metrics of a scheduler and of a router really serve, not only the constants: their
    exposition, rendered by the services' own metric classes after one request's observations."""
    import dataclasses

    from services.replica.metrics import SchedulerMetrics
    from services.router.metrics import RouterMetrics
    from services.scheduler.request_output import SchedulerStats

    # Every plain counter 1; nested stats (the structured-output counters) keep their own type, all ones too.
    # The adapter-name fields hold names, so vLLM's lora_requests_info series is exported too.
    names = {"running_loras": ("sql",), "waiting_loras": ("chat",), "expert_tokens": (3, 0)}
    # The speculative-decoding counters exist only with --speculative-config; they are set so their series count.
    from services.scheduler.spec_decode.speculator import SpecDecodeStats
    nested = {"guided", "spec_decode"}
    stats = SchedulerStats(**{f.name: names.get(f.name, 1) for f in dataclasses.fields(SchedulerStats)
                              if f.init and f.name not in nested})
    stats.guided = type(stats.guided)(**{f.name: 1 for f in dataclasses.fields(stats.guided) if f.init})
    stats.spec_decode = SpecDecodeStats(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1,
                                        num_accepted_tokens_per_pos=[1, 0])
    scheduler = SchedulerMetrics(lambda: stats)
    timer = scheduler.timer()
    timer.tokens_now(1)
    timer.tokens_now(3)
    timer.finished()
    router = RouterMetrics()
    router.requests.labels("200").inc()
    router.decisions.labels("prefix", "replica-0").inc()
    exported = _exposed_series(scheduler.render()[0].decode()) | _exposed_series(router.render()[0].decode())

    assert M.AUTOSCALING_METRIC in _exposed_series(scheduler.render()[0].decode())
    adapter = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    cluster_side = {n for rule in adapter["rules"]["custom"] for n in _METRIC.findall(rule["seriesQuery"])}
    keda = parse_documents(helm("template", "llm", str(CHART), "-f", str(K8S / "keda" / "values.yaml"),
                                check=True).stdout)
    cluster_side |= {n for o in keda if o["kind"] == "ScaledObject"
                     for n in _METRIC.findall(o["spec"]["triggers"][0]["metadata"]["query"])}
    dashboard = json.loads((K8S / "grafana" / "pagedserve-dashboard.json").read_text())
    cluster_side |= {n for exprs in _dashboard_exprs(dashboard).values() for e in exprs for n in _METRIC.findall(e)}
    missing = cluster_side - exported
    assert not missing, f"named outside the services but not exported on /metrics: {sorted(missing)}"


def _extras() -> dict[str, list[str]]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_each_image_installs_exactly_the_extras_its_processes_need():
    """The router image carries the Kubernetes client (--discovery kubernetes imports it) and, like the
    scheduler image, no torch or transformers; the engine image has the engine and Triton extras; no
    image has test tools. tests/chart_e2e builds its virtualenvs from these same lines."""
    from tests.chart_e2e.images import install_spec

    extras = _extras()
    base = _names(extras[""])
    assert not base & {"torch", "transformers", "gguf", "accelerate", "safetensors", "triton", "kubernetes"}
    router, scheduler, engine = (install_spec(s) for s in SERVICES)
    assert router.extras == ("k8s",) and "kubernetes" in _names(extras["k8s"])
    assert scheduler.extras == ()
    assert set(engine.extras) == {"engine", "triton"} and {"torch", "transformers"} <= _names(extras["engine"])
    assert router.torch_version is None and scheduler.torch_version is None and engine.torch_version
    for spec in (router, scheduler, engine):
        assert "test" not in spec.extras
    # What the router's discovery imports is what the k8s extra installs.
    source = (REPO / "services" / "router" / "k8s_discovery.py").read_text()
    assert "from kubernetes import" in source
    # Router and scheduler images bake in the tokenizer only; the engine the converted weights.
    assert router.model_convert_args == scheduler.model_convert_args == ("--tokenizer-only",)
    assert engine.model_convert_args == ()
    # `make install` has everything, for development and the tests.
    makefile = (REPO / "Makefile").read_text()
    assert "pip install -q -e '.[engine,k8s,triton,test]'" in makefile
