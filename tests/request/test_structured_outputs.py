"""StructuredOutputsParams: exactly one constraint, bounded sizes, each refusal naming its field."""

from __future__ import annotations

import pytest

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.request.structured_outputs import MAX_CHOICES, MAX_CONSTRAINT_CHARS, StructuredOutputsParams


@pytest.mark.parametrize("kwargs,field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "structured_outputs.regex"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": ["x"] * (MAX_CHOICES + 1)}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": 7}, "structured_outputs.json"),
    ({"json": {"enum": ["x" * MAX_CONSTRAINT_CHARS]}}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"regex": "a", "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern"),
    ({"json_object": True, "whitespace_pattern": ""}, "structured_outputs.whitespace_pattern"),
    ({"json_object": True, "strict": 1}, "structured_outputs.strict"),
    ({"regex": "", "source": "guided_regex"}, "guided_regex"),
])
def test_bad_constraints_name_their_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == field


def test_kinds_keys_and_sampling_params():
    a = StructuredOutputsParams(json='{"type": "object"}')
    b = StructuredOutputsParams(json={"type": "object"}, source="response_format.json_schema.schema")
    assert a.kind == b.kind == "json" and a.cache_key() == b.cache_key()
    assert StructuredOutputsParams(json_object=True).schema() == {"type": "object"}
    assert StructuredOutputsParams(json={"type": "object"}, strict=True).cache_key() != a.cache_key()
    assert StructuredOutputsParams(choice=["a"], json_object=False).kind == "choice"
    assert SamplingParams(structured_outputs=a).structured_outputs is a
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs={"json": {}})
    assert e.value.field == "structured_outputs"
