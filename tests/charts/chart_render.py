"""Render the Helm chart with the real helm binary and look at the objects it produces.

One render per values variant per test session (helm takes ~0.1 s a call); the variants are the files
in charts/pagedserve/ci/ (the chart-testing convention) plus the defaults.
"""

from __future__ import annotations

import base64
import functools
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedserve"
HELM = REPO / ".tools" / "helm"
RELEASE = "llm"
NAMESPACE = "serving"
# The oldest minor still common on managed clusters and the newest kubernetes-validate ships schemas for.
KUBE_VERSIONS = ("1.33", "1.37")
# Kinds from CRDs: no built-in schema; tests/charts checks their structure itself (LeaderWorkerSet:
# against its CRD's pinned schema, tests/charts/lws_schema.py).
CRD_KINDS = frozenset({"ServiceMonitor", "ScaledObject", "HTTPRoute", "LeaderWorkerSet"})
PAGEDSERVE_CONTAINERS = {"router": "router", "engine": "engine", "scheduler": "scheduler",
                         "engine-worker": "engine-worker"}


def variant_files() -> dict[str, Path | None]:
    files = {"default": None}
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        files[path.name.removesuffix("-values.yaml")] = path
    return files


VARIANTS = variant_files()


def ensure_helm() -> Path:
    """The helm binary in .tools/, fetched by `make tools` on first use (so a fresh clone works)."""
    if not HELM.exists():
        subprocess.run(["make", "-s", "tools"], cwd=REPO, check=True)
    return HELM


def helm(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([str(ensure_helm()), *args], cwd=REPO, capture_output=True, text=True, check=check,
                          timeout=120)


def template_args(variant: str = "default", *extra: str) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if VARIANTS[variant] is not None:
        args += ["-f", str(VARIANTS[variant])]
    return args + list(extra)


@dataclass
class Rendered:
    objects: list[dict]
    hooks: list[dict] = field(default_factory=list)

    def all(self) -> list[dict]:
        return self.objects + self.hooks

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.all() if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        matches = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
        return matches[0]

    def one(self, kind: str) -> dict:
        matches = self.of_kind(kind)
        assert len(matches) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in matches]}"
        return matches[0]

    def workloads(self) -> list[dict]:
        """Objects that make pods: Deployments, StatefulSets, Pods, and each pod template of a
        LeaderWorkerSet (leader and worker) as a workload of kind LeaderWorkerSet."""
        out = [o for o in self.all() if o["kind"] in ("Deployment", "StatefulSet", "Pod")]
        for lws in self.of_kind("LeaderWorkerSet"):
            out += lws_pod_templates(lws)
        return out

    def workload(self, component: str) -> dict:
        matches = [w for w in self.workloads() if pod_labels(w).get("app.kubernetes.io/component") == component]
        assert len(matches) == 1, f"expected one workload of component {component}, found {len(matches)}"
        return matches[0]

    def pagedserve_containers(self) -> list[tuple[dict, dict]]:
        """(workload, container) for every container that runs a pagedserve service."""
        return [(w, c) for w in self.workloads() for c in pod_spec(w)["containers"]
                if c["name"] in PAGEDSERVE_CONTAINERS and pod_labels(w).get("app.kubernetes.io/component") != "test"]

    def container(self, name: str) -> dict:
        matches = [c for _, c in self.pagedserve_containers() if c["name"] == name]
        assert len(matches) == 1, f"expected one container {name}, found {len(matches)}"
        return matches[0]

    def secret_value(self, name: str, key: str) -> str:
        return base64.b64decode(self.get("Secret", name)["data"][key]).decode()


def lws_pod_templates(lws: dict) -> list[dict]:
    """A LeaderWorkerSet's leader and worker pod templates, each as {kind, role, metadata, spec.template}."""
    templates = lws["spec"]["leaderWorkerTemplate"]
    return [{"kind": "LeaderWorkerSet", "role": role, "metadata": lws["metadata"],
             "spec": {"template": templates[f"{role}Template"]}} for role in ("leader", "worker")]


def pod_spec(workload: dict) -> dict:
    return workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]


def args_of(container: dict):
    """A rendered container's args as its `pagedserve` command parses them."""
    from services.commands.cli import build_parser

    return build_parser().parse_args(container["args"])


def containers(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec(workload)["containers"]}


def pod_labels(workload: dict) -> dict:
    meta = workload["metadata"] if workload["kind"] == "Pod" else workload["spec"]["template"]["metadata"]
    return meta.get("labels", {})


def parse_documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@functools.cache
def render(variant: str = "default", *extra: str) -> Rendered:
    """helm template of one variant; hook objects (helm test) kept apart from the release's objects."""
    result = helm(*template_args(variant, *extra))
    assert result.returncode == 0, f"helm template {variant} {extra} failed:\n{result.stderr}"
    objects, hooks = [], []
    for doc in parse_documents(result.stdout):
        annotations = doc.get("metadata", {}).get("annotations") or {}
        (hooks if "helm.sh/hook" in annotations else objects).append(doc)
    return Rendered(objects, hooks)


def render_error(*args: str) -> str:
    """stderr of a helm template run that must fail."""
    result = helm(*template_args("default", *args))
    assert result.returncode != 0, f"helm template {args} should have failed but rendered"
    return result.stderr


def selector_matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True
