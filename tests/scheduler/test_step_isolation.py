"""A step that fails because of one request fails that request alone: the others finish with the very
tokens they get without it (the shadow engine also checks every KV slot they read), and every block
comes back. Only an engine that fails for everyone, or is gone, fails everyone."""

from __future__ import annotations

import pytest

from services.contracts.step_protocol import EngineUnavailableError, InvalidStepError
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from tests.scheduler.conftest import shared_tokenizer
from tests.scheduler.shadow_executor import ShadowExecutor

PROMPTS = {f"r{i}": [20 + i] * (5 + 3 * i) for i in range(6)}


class PoisonedExecutor(ShadowExecutor):
    """Raises whenever the poisoned request's sequences are in the step (as a sampler would on a bad row)."""

    def __init__(self, poison: str | None, named: bool = False, **kw):
        super().__init__(**kw)
        self.poison, self.named, self.calls = poison, named, 0

    def execute(self, out):
        self.calls += 1
        bad = [s.seq_id for s in out.sequences if self.poison and s.seq_id.split("#")[0] == self.poison]
        if bad:
            if self.named:
                raise InvalidStepError("block id out of range", bad)
            raise RuntimeError("sampler blew up")
        return super().execute(out)


def run(ex: ShadowExecutor, prompts: dict[str, list[int]], n_for: str = "r2") -> dict:
    core = SchedulerCore(ex, shared_tokenizer(), max_num_seqs=8, max_num_batched_tokens=24)
    ex.lookup = lambda sid: next(r.token_ids for r in core.scheduler.running if r.seq_id == sid)
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2 if rid == n_for else 1)
        core.add_request(rid, prompt, params)
    done = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out
        core.pool.check_invariants()
    assert core.pool.num_in_use == 0, "a block was not returned"
    return done


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("poison", ["r0", "r2", "r5"])
def test_a_step_failure_tied_to_one_request_costs_only_that_request(poison, named):
    clean = run(ShadowExecutor(num_blocks=48, block_size=4), PROMPTS)
    ex = PoisonedExecutor(poison, named, num_blocks=48, block_size=4)
    got = run(ex, PROMPTS)
    bad = got[poison]
    assert bad.error_kind == "request" and "failed on this request" in bad.error
    assert all(o.finish_reason == "error" for o in bad.outputs)
    for rid in PROMPTS:
        if rid != poison:
            assert got[rid].error is None
            assert [o.token_ids for o in got[rid].outputs] == [o.token_ids for o in clean[rid].outputs], rid
    assert ex.calls < 3 * len(clean) + 20  # bisection is paid once, not every step


def test_a_step_that_fails_for_everyone_is_the_engine():
    class Broken(ShadowExecutor):
        def execute(self, out):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    core = SchedulerCore(Broken(num_blocks=48, block_size=4), shared_tokenizer(), max_num_seqs=8)
    for rid, prompt in list(PROMPTS.items())[:3]:
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        core.step()
    outs = core.fail_all("engine failure")
    assert {o.error_kind for o in outs} == {"engine"} and core.pool.num_in_use == 0


def test_an_engine_that_is_gone_is_not_bisected():
    class Gone(ShadowExecutor):
        calls = 0

        def execute(self, out):
            Gone.calls += 1
            raise EngineUnavailableError("connection to engine lost during 'step'")

    core = SchedulerCore(Gone(num_blocks=48, block_size=4), shared_tokenizer(), max_num_seqs=8)
    for rid, prompt in list(PROMPTS.items())[:4]:
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(EngineUnavailableError):
        core.step()
    assert Gone.calls == 1
