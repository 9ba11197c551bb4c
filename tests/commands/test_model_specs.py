"""`pagedserve up --model` parsing: one PATH as before, NAME=PATH[:REPLICAS] repeated, and clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.commands.cli import build_parser
from services.commands.model_specs import ModelSpec, parse_model_specs
from services.commands.up import LocalCluster


def test_one_plain_path_keeps_working():
    assert parse_model_specs(None, 2) == [ModelSpec(None, None, 2)]
    assert parse_model_specs("/m/smol", 3, "smol") == [ModelSpec("smol", "/m/smol", 3)]
    assert parse_model_specs(["/m/a=b"], 1) == [ModelSpec(None, "/m/a=b", 1)]  # '=' inside a path


def test_several_named_models_with_replicas_each():
    specs = parse_model_specs(["a=/m/one", "b=/m/two:3", "c=/m/x:y"], 2)
    assert specs == [ModelSpec("a", "/m/one", 2), ModelSpec("b", "/m/two", 3), ModelSpec("c", "/m/x:y", 2)]


@pytest.mark.parametrize("models,replicas,served,needle", [
    (["a=/m/one", "/m/two"], 1, None, "each is NAME=PATH"),
    (["a=/m/one", "a=/m/two"], 1, None, "given twice"),
    (["a=/m/one", "b=/m/two"], 1, "x", "--served-model-name"),
    (["a=/m/one", "b=:2"], 1, None, "no path"),
    (["a=/m/one", "b=/m/two:0"], 1, None, "at least 1"),
    (["a b=/m/one", "c=/m/two"], 1, None, "not a valid model name"),
    (None, 0, None, "--replicas"),
])
def test_bad_specs_are_refused_by_name(models, replicas, served, needle):
    with pytest.raises(ValueError, match=needle):
        parse_model_specs(models, replicas, served)


@given(st.lists(st.text(max_size=30), min_size=1, max_size=4), st.integers(-2, 4))
def test_any_input_parses_or_raises_value_error(models, replicas):
    try:
        specs = parse_model_specs(models, replicas)
    except ValueError:
        return
    assert all(s.replicas >= 1 for s in specs)


def test_up_plans_replicas_per_model_and_routers_without_a_model():
    args = build_parser().parse_args(["up", "--model", "a=/m/one", "--model", "b=/m/two:1", "--replicas", "2",
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    cluster = LocalCluster(args, args.replicas, args.routers)
    cluster._plan()
    assert cluster.replica_ids == ["a-0", "a-1", "b-0"]
    for sched, model, path in zip(cluster.schedulers, "aab", ["/m/one", "/m/one", "/m/two"], strict=True):
        argv = sched.argv
        assert argv[argv.index("--served-model-name") + 1] == model and argv[argv.index("--model") + 1] == path
    assert [e.argv[e.argv.index("--model") + 1] for e in cluster.engines] == ["/m/one", "/m/one", "/m/two"]
    assert "--model" not in cluster.routers[0].argv
