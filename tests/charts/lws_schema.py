"""The LeaderWorkerSet CRD's schema, pinned (tests/charts/fixtures/leaderworkerset-v1.schema.json), and a
strict validation of rendered LeaderWorkerSets against it.

kubernetes-validate knows only built-in kinds, so the chart checks validate a LeaderWorkerSet against
the CRD's own openAPIV3Schema, the way the API server does with strict field validation (`kubectl
apply`'s default): an unknown field anywhere is an error, except where the schema preserves unknown
fields. `python -m tests.charts.lws_schema CRD.yaml` rewrites the fixture from an upstream CRD file.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jsonschema

FIXTURE = Path(__file__).parent / "fixtures" / "leaderworkerset-v1.schema.json"
API_VERSION = "leaderworkerset.x-k8s.io/v1"


def _strict(node):
    """Reject unknown fields where the CRD declares its fields (structural schemas prune them silently;
    strict field validation refuses them)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def pinned() -> dict:
    return json.loads(FIXTURE.read_text())


@functools.cache
def _validator() -> jsonschema.Draft7Validator:
    schema = _strict(pinned()["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict) -> None:
    """Raise jsonschema.ValidationError unless `obj` is a valid LeaderWorkerSet."""
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != "LeaderWorkerSet":
        raise jsonschema.ValidationError(f"not a {API_VERSION} LeaderWorkerSet: {obj.get('apiVersion')} "
                                         f"{obj.get('kind')}")
    if not obj.get("metadata", {}).get("name"):
        raise jsonschema.ValidationError("metadata.name is required")
    error = jsonschema.exceptions.best_match(_validator().iter_errors(obj))
    if error is not None:
        raise error


def _regenerate(crd_path: str) -> None:
    import yaml

    crd = yaml.safe_load(Path(crd_path).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "description"}
        return [strip(v) for v in node] if isinstance(node, list) else node

    out = dict(pinned(), subresources=version.get("subresources"),
               openAPIV3Schema=strip(version["schema"]["openAPIV3Schema"]))
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE} (update the $comment's version and commit)")


if __name__ == "__main__":
    _regenerate(sys.argv[1])
