"""values.schema.json rejects bad values at install time with a message that names the value and the
rule; combinations the schema cannot express fail in the templates with the value to change."""

from __future__ import annotations

import json

import pytest
import yaml

from services.commands import settings
from tests.charts.chart_render import CHART, render, render_error

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.mark.parametrize("args, where, reason", [
    (["--set", "router.replicaCount=-1"], "/router/replicaCount", "minimum: got -1, want 0"),
    (["--set", "replica.replicaCount=-2"], "/replica/replicaCount", "minimum: got -2, want 0"),
    (["--set", "router.policy=fastest"], "/router/policy",
     "value must be one of 'prefix', 'least-loaded', 'round-robin', 'session'"),
    (["--set-string", "replica.engine.gpus=1"], "/replica/engine/gpus", "got string, want integer"),
    (["--set", "replica.engine.gpus=two"], "/replica/engine/gpus", "got string, want integer"),
    (["--set", "replica.engine.gpus=-1"], "/replica/engine/gpus", "minimum: got -1, want 0"),
    (["--set", "model.dtype=int4"], "/model/dtype", "value must be one of 'bfloat16', 'float16', 'float32'"),
    (["--set", "model.source=s3"], "/model/source", "value must be one of 'bundled', 'pvc', 'hostPath'"),
    (["--set", "model.source=pvc"], "/model/pvc/claimName", "minLength: got 0, want 1"),
    (["--set", "replica.engine.kvCacheMemory=lots"], "/replica/engine/kvCacheMemory", "does not match pattern"),
    (["--set", "router.discovery=consul"], "/router/discovery", "value must be one of 'redis', 'kubernetes'"),
    (["--set", "autoscaling.targetWaitingPerReplica=0"], "/autoscaling/targetWaitingPerReplica",
     "exclusiveMinimum"),
    (["--set", "router.ingress.host=Bad_Host"], "/router/ingress/host", "does not match pattern"),
    (["--set", "images.engine.digest=latest"], "/images/engine/digest", "does not match pattern"),
    (["--set", "redis.external.url=http://redis:6379"], "/redis/external/url", "does not match pattern"),
    (["--set", "replica.engine.gpu=1"], "/replica/engine", "additional properties 'gpu' not allowed"),
    (["--set", "routr.policy=prefix"], "at ''", "additional properties 'routr' not allowed"),
])
def test_invalid_values_fail_with_a_clear_schema_message(args, where, reason):
    err = render_error(*args)
    assert "values don't meet the specifications of the schema" in err, err
    assert where in err and reason in err, f"expected {where!r} and {reason!r} in:\n{err}"


@pytest.mark.parametrize("args, message", [
    (["--set", "autoscaling.minReplicas=5", "--set", "autoscaling.maxReplicas=2"],
     "autoscaling.minReplicas (5) must not exceed autoscaling.maxReplicas (2)"),
    (["--set", "autoscaling.enabled=true", "--set", "autoscaling.minReplicas=0"],
     "autoscaling.minReplicas must be at least 1 for the HPA; scale to zero needs keda.enabled=true"),
    (["--set", "keda.enabled=true"], "keda.serverAddress is required when keda.enabled=true"),
    (["--set", "redis.enabled=false"], "redis.enabled=false needs redis.external.url or redis.external.existingSecret"),
    (["--set", "router.ingress.enabled=true", "--set", "router.ingress.tls.enabled=true",
      "--set", "router.ingress.tls.secretName=tls"], "router.ingress.host is required"),
    (["--set", "router.ingress.tls.enabled=true", "--set", "router.ingress.host=a.example.com"],
     "router.ingress.tls.secretName is required"),
    (["--set", "router.httpRoute.enabled=true"], "router.httpRoute.parentRefs must name at least one Gateway"),
])
def test_inconsistent_values_fail_with_the_value_to_change(args, message):
    err = render_error(*args)
    assert message in err, err


@pytest.mark.parametrize("path, option", [
    (("router", "policy"), settings.POLICY),
    (("router", "cacheIsolation"), settings.CACHE_ISOLATION),
    (("router", "discovery"), settings.DISCOVERY),
    (("model", "dtype"), settings.DTYPE),
    (("logLevel",), settings.LOG_LEVEL),
])
def test_schema_choices_are_the_services_choices(path, option):
    """One source of truth: the schema accepts exactly what the services' flags accept."""
    node = SCHEMA
    for key in path:
        node = node["properties"][key]
    assert tuple(node["enum"]) == option.choices


def _walk(schema: dict, values: dict, path: str, problems: list[str]) -> None:
    if "$ref" in schema:
        schema = SCHEMA["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    props = schema.get("properties")
    if props is None or schema.get("additionalProperties") is not False:
        return
    for key in set(props) - set(values) - {"global"}:
        problems.append(f"{path}{key}: in the schema but not in values.yaml (undocumented value)")
    for key, value in values.items():
        # An empty map ({} in values.yaml: resources, probe overrides) is documented as a whole.
        if isinstance(value, dict) and value and key in props:
            _walk(props[key], value, f"{path}{key}.", problems)


def test_schema_and_values_yaml_describe_the_same_keys():
    problems: list[str] = []
    _walk(SCHEMA, VALUES, "", problems)
    assert not problems, "\n".join(problems)


def test_values_yaml_documents_every_top_level_key():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for key in VALUES:
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        assert lines[index - 1].startswith("#"), f"values.yaml: {key} has no comment above it"


@pytest.mark.parametrize("args, where, reason", [
    # The bundled SmolLM2-135M: 9 heads, 3 KV heads: one engine splits into 1 or 3 ranks only.
    (["--set", "replica.engine.gpus=2"], "/replica/engine/gpus", "value must be one of 0, 1, 3"),
    (["--set", "replica.engine.gpus=9"], "/replica/engine/gpus", "value must be one of 0, 1, 3"),
    (["--set", "replica.nodes=2"], "/replica/nodes", "value must be one of 1, 3"),
    (["--set", "replica.nodes=3", "--set", "replica.engine.gpus=3"], "/replica/engine/gpus", "value must be 1"),
    # Whatever the model: a replica spanning nodes runs on GPUs.
    (["--set", "model.source=pvc", "--set", "model.pvc.claimName=m", "--set", "replica.nodes=2",
      "--set", "replica.engine.gpus=0"], "/replica/engine/gpus", "minimum: got 0, want 1"),
    (["--set", "replica.nodes=0"], "/replica/nodes", "minimum: got 0, want 1"),
    (["--set", "replica.multiNode.rendezvousPort=70000"], "/replica/multiNode/rendezvousPort", "maximum"),
    (["--set", "replica.engine.tensorParallelTimeoutSeconds=0"], "/replica/engine/tensorParallelTimeoutSeconds",
     "exclusiveMinimum"),
])
def test_a_split_the_model_cannot_take_is_refused(args, where, reason):
    err = render_error(*args)
    assert "values don't meet the specifications of the schema" in err, err
    assert where in err and reason in err, f"expected {where!r} and {reason!r} in:\n{err}"


def test_the_bundled_models_split_is_the_engines():
    """The schema's sizes for the bundled model are the ones the engine itself accepts for it."""
    from services.engine.tp_shard import valid_sizes
    from services.model_files.model_source import resolve_tokenizer

    # The bundled model's own config (extracted once from its GGUF file, no weights converted).
    config = json.loads((resolve_tokenizer(None) / "config.json").read_text())
    fits = valid_sizes(config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"])
    bundled = next(r for r in SCHEMA["allOf"] if r.get("if", {}).get("properties", {}).get("model"))
    gpus = bundled["then"]["properties"]["replica"]["properties"]["engine"]["properties"]["gpus"]["enum"]
    assert sorted(set(gpus) - {0}) == fits == [1, 3]


def test_several_gpus_and_nodes_render_where_the_model_splits():
    for args in (["--set", "replica.engine.gpus=3"], ["--set", "replica.nodes=3"],
                 ["--set", "model.source=pvc", "--set", "model.pvc.claimName=m", "--set", "replica.engine.gpus=8",
                  "--set", "replica.nodes=2"]):
        render("default", *args)


def test_several_gpus_need_a_dev_shm():
    err = render_error("--set", "replica.engine.gpus=3", "--set", "replica.engine.shmSize=")
    assert "replica.engine.shmSize is required when replica.engine.gpus > 1" in err


def test_per_key_cache_isolation_needs_api_keys():
    err = render_error("--set", "router.cacheIsolation=per-key")
    assert ("router.cacheIsolation=per-key isolates API keys from each other: it needs "
            "router.apiKeys.enabled=true") in err
