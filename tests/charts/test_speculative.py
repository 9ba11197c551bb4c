"""Speculative decoding in the chart (`speculativeConfig`): the engine and the scheduler of a replica get
the same --speculative-config, a draft model is read from the model volume, and values that cannot be
served are refused at render time by name."""

from __future__ import annotations

import json

from services.contracts.speculative_config import SpeculativeConfig
from tests.charts.chart_render import RELEASE, args_of, containers, render, render_error

FULLNAME = f"{RELEASE}-pagedserve"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def replica_args(*extra: str):
    c = containers(render("default", *extra).get("Deployment", f"{FULLNAME}-replica"))
    return args_of(c["engine"]), args_of(c["scheduler"])


def test_off_by_default():
    engine, scheduler = replica_args()
    assert engine.speculative_config is None and scheduler.speculative_config is None


def test_engine_and_scheduler_get_the_same_config():
    engine, scheduler = replica_args("--set-json", f"speculativeConfig={json.dumps(NGRAM)}")
    assert engine.speculative_config == scheduler.speculative_config
    assert SpeculativeConfig.parse(engine.speculative_config) == SpeculativeConfig.parse(NGRAM)


def test_a_draft_model_is_read_from_the_model_volume():
    spec = {"method": "draft_model", "model": "drafts/smol-135m", "num_speculative_tokens": 3}
    engine, scheduler = replica_args("--set", "model.source=pvc", "--set", "model.pvc.claimName=models",
                                     "--set", "model.path=smol-1.7b",
                                     "--set-json", f"speculativeConfig={json.dumps(spec)}")
    parsed = SpeculativeConfig.parse(engine.speculative_config)
    assert parsed.model == "/models/drafts/smol-135m" and parsed.method == "draft_model"
    assert scheduler.speculative_config == engine.speculative_config
    assert "model.source" in render_error("--set-json", f"speculativeConfig={json.dumps(spec)}")


def test_values_that_cannot_be_served_are_refused():
    assert "speculativeConfig" in render_error("--set-json", 'speculativeConfig={"method": "eagle", '
                                                             '"num_speculative_tokens": 2}')
    assert "speculativeConfig" in render_error("--set-json", 'speculativeConfig={"method": "ngram", '
                                                             '"num_speculative_tokens": 2, "typo": 1}')
    assert "speculativeConfig" in render_error("--set-json", 'speculativeConfig={"method": "ngram"}')
