"""helm lint --strict, and every values variant renders into objects that the Kubernetes API would accept.

Built-in kinds are validated against the Kubernetes OpenAPI schemas shipped by kubernetes-validate, in
strict mode (unknown fields rejected), for two Kubernetes minors. CRD kinds have no built-in schema:
their structure is checked here against the fields of their CRDs that the chart uses, and a
LeaderWorkerSet against its CRD's whole pinned schema (tests/charts/fixtures), its pod templates
against the built-in PodTemplate schema too.
"""

from __future__ import annotations

import functools
import re

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import pytest

from tests.charts import lws_schema
from tests.charts.chart_render import (
    CHART,
    CRD_KINDS,
    KUBE_VERSIONS,
    NAMESPACE,
    VARIANTS,
    helm,
    lws_pod_templates,
    render,
    template_args,
)

# kubernetes-validate re-reads its multi-megabyte definitions file on every call; the files never
# change within a run, so read each once (this keeps the whole matrix at a few seconds).
kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)

STANDARD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                   "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
                   "helm.sh/chart")

# The issue's list of variants that must render and validate.
REQUIRED_VARIANTS = {"default", "keda", "external-redis", "ingress-tls", "api-keys", "cpu", "gpu"}


def test_the_required_variants_exist():
    assert REQUIRED_VARIANTS <= set(VARIANTS), f"missing variants: {REQUIRED_VARIANTS - set(VARIANTS)}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_strict_is_clean(variant):
    args = ["lint", "--strict", str(CHART)]
    if VARIANTS[variant] is not None:
        args += ["-f", str(VARIANTS[variant])]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    findings = [line for line in result.stdout.splitlines() if re.match(r"\[(INFO|WARNING|ERROR)\]", line.strip())]
    assert not findings, f"helm lint reports: {findings}"


def _crd_schema(kind: str) -> dict:
    """The parts of each CRD's schema that the chart uses (from the CRDs' own OpenAPI definitions)."""
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    selector = {"type": "object", "properties": {"matchLabels": string_map}, "required": ["matchLabels"]}
    duration = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                             r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
    if kind == "ServiceMonitor":  # monitoring.coreos.com/v1
        spec = {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                "properties": {
                    "selector": selector,
                    "namespaceSelector": {"type": "object", "properties": {
                        "matchNames": {"type": "array", "items": {"type": "string"}}}},
                    "endpoints": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["port"],
                        "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                       "interval": duration, "scrapeTimeout": duration}}}}}
        api = "monitoring.coreos.com/v1"
    elif kind == "ScaledObject":  # keda.sh/v1alpha1
        spec = {"type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                                       "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                      "name": {"type": "string"}}},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "advanced": {"type": "object", "additionalProperties": False, "properties": {
                        "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False,
                                                          "properties": {"name": {"type": "string"},
                                                                         "behavior": {"type": "object"}}}}},
                    "triggers": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            # KEDA's CRD types trigger metadata as map[string]string.
                            "metadata": string_map,
                            "authenticationRef": {"type": "object", "required": ["name"]}}}}}}
        api = "keda.sh/v1alpha1"
    else:  # HTTPRoute, gateway.networking.k8s.io/v1
        spec = {"type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
                "properties": {
                    "parentRefs": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["name"]}},
                    "hostnames": {"type": "array", "items": {"type": "string"}},
                    "rules": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array", "items": {"type": "object", "properties": {"path": {
                                "type": "object", "required": ["type", "value"], "properties": {
                                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                    "value": {"type": "string", "pattern": "^/"}}}}}},
                            "backendRefs": {"type": "array", "items": {
                                "type": "object", "required": ["name", "port"],
                                "properties": {"name": {"type": "string"}, "port": {"type": "integer"}}}},
                            "timeouts": {"type": "object", "additionalProperties": False, "properties": {
                                "request": {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}}}}}}}}
        api = "gateway.networking.k8s.io/v1"
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": api}, "kind": {"const": kind},
                           "metadata": {"type": "object", "required": ["name", "namespace"]}, "spec": spec}}


def _validate_crd_object(obj: dict, kube_version: str) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        # Its CRD's own pinned schema, strictly; then each pod template as the built-in kind it is.
        lws_schema.validate(obj)
        for template in lws_pod_templates(obj):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                          "template": template["spec"]["template"]}, kube_version, strict=True)
        return
    jsonschema.validate(obj, _crd_schema(obj["kind"]))
    if obj["kind"] == "ScaledObject":
        # KEDA hands this behavior to the HPA it creates: validate it as an autoscaling/v2 HPA's.
        behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
               "spec": {"scaleTargetRef": obj["spec"]["scaleTargetRef"], "maxReplicas": 1, "behavior": behavior}}
        kubernetes_validate.validate(hpa, kube_version, strict=True)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rendered_object_validates(variant, kube_version):
    rendered = render(variant)
    assert rendered.objects, "nothing rendered"
    errors = []
    for obj in rendered.all():
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            if obj["kind"] in CRD_KINDS:
                _validate_crd_object(obj, kube_version)
            else:
                kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{where}: no Kubernetes {kube_version} schema for {obj['apiVersion']} {obj['kind']} "
                          f"(a CRD kind must be added to CRD_KINDS with a structural check)")
        except jsonschema.ValidationError as err:
            path = ".".join(str(p) for p in err.absolute_path)
            errors.append(f"{where}: {path}: {err.message}")
    assert not errors, f"{variant} on Kubernetes {kube_version}:\n" + "\n".join(errors)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_object_is_labelled_and_namespaced(variant):
    for obj in render(variant).all():
        meta = obj["metadata"]
        assert meta.get("namespace") == NAMESPACE, f"{obj['kind']}/{meta['name']} has no namespace"
        missing = [label for label in STANDARD_LABELS if label not in (meta.get("labels") or {})]
        assert not missing, f"{obj['kind']}/{meta['name']} lacks labels {missing}"
        assert len(meta["name"]) <= 63, f"{obj['kind']}/{meta['name']} name too long"


def test_long_release_names_still_give_valid_object_names():
    long_name = "a-very-long-release-name-from-a-ci-system-for-preview"  # Helm's limit: 53 characters
    assert len(long_name) == 53
    result = helm("template", long_name, str(CHART), "--namespace", NAMESPACE)
    assert result.returncode == 0, result.stderr
    from tests.charts.chart_render import parse_documents

    for obj in parse_documents(result.stdout):
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)


def _value_paths(values: dict, prefix: str = ""):
    for key, value in values.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from _value_paths(value, f"{prefix}{key}.")


# A chart's own `fail`/`required` messages name the value; Go template errors on nil do not.
_CHART_MESSAGE = re.compile(r"is required|must |needs |execution error at \(pagedserve/templates/[^)]*\): [a-z]")
_GO_ERRORS = ("reflect", "nil pointer", "wrong type for value", "interface conversion", "can't evaluate field")


def test_every_value_the_schema_allows_renders():
    """`--set x=null` removes a value, which the schema allows for every key it does not require: the
    templates must then render with their defaults (or fail with the chart's own message), never with a
    Go reflect/nil error. That was `--set replica.engine.resources=null`."""
    import concurrent.futures

    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    paths = [p for p in _value_paths(values) if p.count(".") <= 3]

    def attempt(path: str) -> tuple[str, str]:
        result = helm(*template_args("default", "--set", f"{path}=null"))
        return path, "" if result.returncode == 0 else result.stderr

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(attempt, paths))
    broken = [f"{path}: {err.strip().splitlines()[-1]}" for path, err in outcomes
              if err and (any(g in err for g in _GO_ERRORS) or not ("schema" in err or _CHART_MESSAGE.search(err)))]
    assert not broken, "\n".join(broken)
    assert dict(outcomes)["replica.engine.resources"] == ""
    for component in ("router", "replica.scheduler", "redis", "model.convert"):
        assert dict(outcomes)[f"{component}.resources"] == "", component


def test_rendering_is_stable_with_existing_secrets():
    """helm template-based GitOps (Argo CD) renders on every sync: with existingSecret for Redis and the
    API keys nothing random is rendered, so two renders are identical. Without them a generated password
    or key changes on every render (the chart README says to use existingSecret there)."""
    first, second = (helm(*template_args("existing-secrets")) for _ in range(2))
    assert first.returncode == 0 and first.stdout == second.stdout
    generated = [helm(*template_args("api-keys", "--set", "router.apiKeys.keys=null")).stdout for _ in range(2)]
    assert generated[0] != generated[1], "generated secrets differ per render: the reason for existingSecret"
