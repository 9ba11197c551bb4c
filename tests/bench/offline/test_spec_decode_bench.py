"""bench spec-decode's ceiling of prompt lookup: replaying greedy outputs through the proposer."""

from __future__ import annotations

import pytest

from services.bench.offline.spec_decode import lookup_ceiling
from services.contracts.speculative_config import SpeculativeConfig

CFG = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                              '"prompt_lookup_min": 2}')


def test_an_output_that_copies_its_prompt_takes_k_plus_one_tokens_a_step():
    prompt = list(range(1, 41)) + [11, 12]  # ends on a bigram seen earlier: the first lookup drafts 13..16
    out = list(range(13, 38))  # copies 25 tokens of the prompt
    c = lookup_ceiling([prompt], [out], CFG, {"a": 10.0, "b": 0.0})
    # 25 tokens in 5 steps of 4 accepted drafts plus the verified token: 5x at a flat step cost.
    assert c["tokens_per_step"] == pytest.approx(5.0)
    assert c["speedup"] == pytest.approx(5.0)


def test_nothing_to_copy_is_one_token_a_step_and_no_speedup():
    prompt = list(range(100, 120))
    out = list(range(500, 530))
    c = lookup_ceiling([prompt], [out], CFG, {"a": 10.0, "b": 1.0})
    assert c == {"tokens_per_step": 1.0, "speedup": pytest.approx(1.0)}


def test_drafts_that_are_rejected_cost_their_tokens():
    prompt = [1, 2, 3, 4, 5, 1, 2]  # lookup drafts 3, 4, 5, 1; the model says 9
    c = lookup_ceiling([prompt], [[9]], CFG, {"a": 0.0, "b": 1.0})
    # One token for a step of 5: a fifth of plain decoding's speed where a step costs only its tokens.
    assert c == {"tokens_per_step": 1.0, "speedup": pytest.approx(0.2)}
