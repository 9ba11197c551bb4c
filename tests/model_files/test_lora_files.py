"""PEFT adapter files checked without torch: a well-formed adapter reads and hashes stably, and any
hostile config, header or byte string is an AdapterError naming a field, never another exception."""

from __future__ import annotations

import json
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.model_files.lora_files import CONFIG_FILE, WEIGHTS_FILE, AdapterError, read_adapter, tensor_key

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "bias": "none"}


def _safetensors(tensors: dict[str, list[int]]) -> bytes:
    header, at = {}, 0
    for key, shape in tensors.items():
        n = 4 * shape[0] * shape[1]
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(at)


def _tensors(rank: int = 4) -> dict[str, list[int]]:
    return {tensor_key(0, "q_proj", "A"): [rank, 64], tensor_key(0, "q_proj", "B"): [64, rank],
            tensor_key(1, "down_proj", "A"): [rank, 128], tensor_key(1, "down_proj", "B"): [64, rank]}


def _write(d, config: bytes, weights: bytes):
    d.mkdir(parents=True, exist_ok=True)
    (d / CONFIG_FILE).write_bytes(config)
    (d / WEIGHTS_FILE).write_bytes(weights)
    return d


def test_a_good_adapter_reads_and_its_digest_is_its_content(tmp_path):
    a = _write(tmp_path / "a", json.dumps(CONFIG).encode(), _safetensors(_tensors()))
    files = read_adapter("a", str(tmp_path), max_rank=8)
    assert files.rank == 4 and files.scale == 2.0 and files.target_modules == ("q_proj", "down_proj")
    assert read_adapter(str(a), str(tmp_path), 8).digest == files.digest
    b = _write(tmp_path / "b", json.dumps(CONFIG).encode(), _safetensors(_tensors()))
    assert read_adapter(str(b), str(tmp_path), 8).digest == files.digest, "same bytes, same identity"
    (b / WEIGHTS_FILE).write_bytes((b / WEIGHTS_FILE).read_bytes()[:-1] + b"\x01")
    assert read_adapter(str(b), str(tmp_path), 8).digest != files.digest
    rs = _write(tmp_path / "rs", json.dumps({**CONFIG, "use_rslora": True}).encode(), _safetensors(_tensors()))
    assert read_adapter(str(rs), str(tmp_path), 8).scale == 4.0


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda c: {**c, "r": 32}, "r"),
    (lambda c: {**c, "r": "4"}, "r"),
    (lambda c: {**c, "peft_type": "IA3"}, "peft_type"),
    (lambda c: {**c, "use_dora": True}, "use_dora"),
    (lambda c: {**c, "target_modules": ["lm_head"]}, "target_modules"),
    (lambda c: {**c, "rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    (lambda c: {**c, "lora_alpha": -1}, "lora_alpha"),
])
def test_bad_configs_name_their_field(tmp_path, mutate, field):
    _write(tmp_path / "x", json.dumps(mutate(dict(CONFIG))).encode(), _safetensors(_tensors()))
    with pytest.raises(AdapterError) as e:
        read_adapter("x", str(tmp_path), max_rank=8)
    assert e.value.field == field


def test_paths_outside_the_allowed_directory_are_refused(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    _write(outside, json.dumps(CONFIG).encode(), _safetensors(_tensors()))
    allowed.mkdir()
    os.symlink(outside, allowed / "link")
    for path in ("../outside", str(outside), "link", "/etc"):
        with pytest.raises(AdapterError) as e:
            read_adapter(path, str(allowed), 8)
        assert e.value.field == "lora_path"
    with pytest.raises(AdapterError, match="at run time is off"):
        read_adapter(str(outside), None, 8)


scalars = st.none() | st.booleans() | st.integers(-5, 600) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
configs = st.fixed_dictionaries({}, optional={
    "peft_type": st.sampled_from(["LORA", "IA3", None]) | json_values, "r": st.integers(-2, 40) | json_values,
    "lora_alpha": st.floats(allow_nan=True) | json_values, "use_rslora": json_values, "use_dora": json_values,
    "target_modules": st.lists(st.sampled_from(["q_proj", "v_proj", "down_proj", "lm_head", "x"]), max_size=4)
    | json_values, "bias": json_values, "rank_pattern": json_values, "modules_to_save": json_values})
shapes = st.lists(st.integers(-1, 200), min_size=0, max_size=3) | json_values
headers = st.dictionaries(
    st.sampled_from([tensor_key(0, "q_proj", "A"), tensor_key(0, "q_proj", "B"), tensor_key(9, "v_proj", "A"),
                     "base_model.model.lm_head.weight", "__metadata__", "x"]) | st.text(max_size=30),
    st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "BF16", "I64"]) | json_values, "shape": shapes})
    | json_values, max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs, headers, st.binary(max_size=64))
def test_hostile_adapters_are_adapter_errors(tmp_path, config, header, tail):
    raw = json.dumps(header).encode()
    _write(tmp_path / "h", json.dumps(config).encode(), struct.pack("<Q", len(raw)) + raw + tail)
    try:
        read_adapter("h", str(tmp_path), max_rank=16)
    except AdapterError as e:
        assert e.field and e.message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_garbage_bytes_are_adapter_errors(tmp_path, config, weights):
    _write(tmp_path / "g", config, weights)
    with pytest.raises(AdapterError):
        read_adapter("g", str(tmp_path), max_rank=16)
