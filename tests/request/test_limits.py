"""One table of request limits, one verdict at every process boundary.

Requests are generated at and beyond every bound of services.request.limits (and of the vocabulary) and
sent through the real router and the real replica over HTTP (the replica's scheduler core is real, its
engine a null one that validates every step it is sent as the engine does), to the scheduler's own
check (`SamplingParams` and `SchedulerCore.validate`, as the offline API and a replica call them) and to
the engine's wire validation (the step the scheduler would build from the same values). All four must
accept the same requests and refuse the same ones, each with a 4xx naming the same field.

Only what the HTTP API alone can say is left out of the four-way comparison: the context-length rule
(OpenAI's 400 `context_length_exceeded`, applied identically by router and replica; the offline API stops
at the context length instead), so generated `max_tokens` stay within the context unless at a range edge.
"""

from __future__ import annotations

import asyncio
import math
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.bench.offline.null_executor import NullExecutor
from services.contracts.step_protocol import ScheduledSequence, SchedulerOutput
from services.engine.step_validation import StepLimits, find_faults
from services.registry.memory_index import MemoryIndex
from services.registry.model import ReplicaInfo, ReplicaLoad, ReplicaState
from services.replica.service import ReplicaSettings, build_replica
from services.request import limits as L
from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.router.app import create_router_app
from services.router.auth import ApiKeys
from services.router.service import RouterConfig, RouterService
from services.scheduler.sequence import Sequence, penalty_template
from tests.conftest import AppServer

MODEL = "limits-model"
MAX_LEN = 256
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
VOCAB = 49152  # SmolLM2's, which the null engine reports too


class ValidatingNullEngine(NullExecutor):
    """The null engine, checking every step it is sent with the engine's own wire validation."""

    def __init__(self):
        super().__init__(num_blocks=4096, block_size=16, vocab_size=VOCAB)
        self.info.max_model_len = MAX_LEN
        self.faults: list = []

    def execute(self, out: SchedulerOutput):
        limits = StepLimits(self.info.block_size, self.info.num_kv_blocks, self.info.max_model_len, VOCAB)
        self.faults += find_faults(out, limits)
        return super().execute(out)


@pytest.fixture(scope="module")
def system(smol_tokenizer):
    engine = ValidatingNullEngine()
    replica = build_replica(engine, smol_tokenizer, ReplicaSettings(MODEL, max_num_seqs=32, max_model_len=MAX_LEN))
    index = MemoryIndex()
    with AppServer(replica.app) as replica_server:
        info = ReplicaInfo("r1", replica_server.url, MODEL, 16, MAX_LEN, 32, replica.replica.core.hash_seed,
                           tokenizer_digest=smol_tokenizer.digest)
        asyncio.run(index.write_tokenizer(smol_tokenizer.digest, smol_tokenizer.bundle))
        asyncio.run(index.write_state(ReplicaState(info, ReplicaLoad()), ttl=3600))
        router = RouterService(RouterConfig(), smol_tokenizer, index, ApiKeys.from_sources(None, None))
        with AppServer(create_router_app(router, router.metrics.render)) as router_server:
            with httpx.Client(timeout=30) as client:
                yield {"router": router_server.url, "replica": replica_server.url, "client": client,
                       "core": replica.replica.core, "engine": engine, "lock": threading.Lock()}
    replica.replica.loop.shutdown()


# -- generated requests -------------------------------------------------------------------------------------

def _edges(bound: L.Range) -> list:
    """Values at, just inside and just beyond each finite edge, and values of the wrong type."""
    out: list = []
    for edge in (bound.lo, bound.hi):
        if edge is None:
            continue
        if bound.integer:
            out += [edge - 1, edge, edge + 1]
        else:
            out += [edge, math.nextafter(edge, -math.inf), math.nextafter(edge, math.inf)]
    out += [1.5, True, "1"] if bound.integer else [True, "0.5", 10**400]
    return out


def _values(bound: L.Range):
    inner = (st.integers(int(bound.lo if bound.lo is not None else -(2**70)),
                         int(bound.hi if bound.hi is not None else 2**70))
             if bound.integer else st.floats(allow_nan=False, allow_infinity=False,
                                              min_value=bound.lo, max_value=bound.hi))
    return st.one_of(st.sampled_from(_edges(bound)), inner)


FIELDS = {name: _values(bound) for name, bound in L.RANGES.items() if name != "max_tokens"}
# Within the context (see the module's docstring); the table's edges of max_tokens are checked below.
FIELDS["max_tokens"] = st.one_of(st.sampled_from([-1, 0, 1, 2, 1.5, True, "2"]), st.integers(1, MAX_LEN - len(PROMPT)))
FIELDS["top_k"] = st.one_of(FIELDS["top_k"], st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1]))
_ids = st.one_of(st.sampled_from([-1, 0, VOCAB - 1, VOCAB, L.TOKEN_ID_LIMIT - 1, L.TOKEN_ID_LIMIT]),
                 st.integers(0, VOCAB - 1))
FIELDS["stop_token_ids"] = st.lists(_ids, max_size=3)
FIELDS["logit_bias"] = st.dictionaries(_ids.filter(lambda t: t >= 0), _values(L.LOGIT_BIAS), max_size=2)

requests = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), min_size=1, max_size=3).flatmap(
    lambda chosen: st.fixed_dictionaries({name: FIELDS[name] for name in chosen}))


def _http_body(fields: dict) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, **fields}
    if "logit_bias" in fields:
        body["logit_bias"] = {str(t): b for t, b in fields["logit_bias"].items()}
    return body


def _offline_fields(fields: dict) -> dict:
    return {"max_tokens": 1, "temperature": 1.0, **fields}


# -- each process's verdict: None (accepted) or the field it names --------------------------------------------

def _over_http(system, url: str, body: dict) -> str | None:
    r = system["client"].post(url + "/v1/completions", json=body)
    if r.status_code == 200:
        return None
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    return r.json()["error"]["param"]


def _scheduler(system, fields: dict) -> str | None:
    try:
        params = SamplingParams(**_offline_fields(fields))
        system["core"].validate(PROMPT, params)
    except InvalidRequestError as exc:
        return exc.field
    except TypeError:  # an unhashable or mistyped value refused by Python itself (e.g. a str compared to an int)
        return "type"
    return None


def _engine(fields: dict) -> list[str]:
    """The fields the engine names for the step the scheduler would build from these values, unvalidated."""
    values = {f.name: f.default for f in SamplingParams.__dataclass_fields__.values()
              if f.init and not callable(f.default)}
    values.update(stop=None, stop_token_ids=[])
    values.update(_offline_fields(fields))
    params = object.__new__(SamplingParams)
    params.__dict__.update(values, stop_strings=[])
    try:
        seq = Sequence("r", PROMPT, params, 0)
        penalties = penalty_template(params, PROMPT)
    except (TypeError, ValueError, AttributeError, OverflowError):  # no step can carry such a value
        return ["type"]
    step = SchedulerOutput(0, [ScheduledSequence("r", PROMPT, 0, [0], True, seq.spec, penalties=penalties)])
    faults = find_faults(step, StepLimits(16, 4096, MAX_LEN, VOCAB))
    return sorted({f.field.rpartition(".")[2] for f in faults})


def _greedy_row(fields: dict) -> bool:
    """The scheduler drops min_p from a row that samples greedily, any effective temperature <= 0
    (sequence.penalty_template); a temperature no number can hold never makes a row at all."""
    try:
        return L.effective_temperature(_offline_fields(fields)["temperature"]) <= 0
    except (TypeError, ValueError, OverflowError):
        return False


def _at_fault(fields: dict) -> set[str]:
    """The fields the table (and the vocabulary) refuse, each judged alone, then the rules between fields."""
    bad = {name for name, v in fields.items() if name in L.RANGES and not L.RANGES[name].admits(v)}
    if "top_k" not in bad and "top_k" in fields and fields["top_k"] > VOCAB:
        bad.add("top_k")
    ids = fields.get("stop_token_ids", [])
    if any(not L.TOKEN_ID.admits(t) or t >= VOCAB for t in ids):
        bad.add("stop_token_ids")
    bias = fields.get("logit_bias", {})
    if any(not L.TOKEN_ID.admits(t) or t >= VOCAB or not L.LOGIT_BIAS.admits(b) for t, b in bias.items()):
        bad.add("logit_bias")
    merged = _offline_fields(fields)
    if not bad & {"min_tokens", "max_tokens"} and merged.get("min_tokens", 0) > merged["max_tokens"]:
        bad.add("min_tokens")
    if not bad & {"best_of", "n"} and "best_of" in fields and fields["best_of"] < fields.get("n", 1):
        bad.add("best_of")
    return bad


# The engine sees a field only as the scheduler puts it on the wire: these request fields reach it.
# (`logprobs` is not among them: the wire carries up to 2W for a beam search of width W, a wider bound that
# the engine checks, services.request.limits.WIRE_LOGPROBS.)
_WIRE = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
         "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
         "repetition_penalty": "repetition_penalty", "min_p": "min_p"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(fields=requests)
def test_router_replica_scheduler_and_engine_accept_and_refuse_the_same_requests(system, fields):
    with system["lock"]:
        body = _http_body(fields)
        router = _over_http(system, system["router"], body)
        replica = _over_http(system, system["replica"], body)
        scheduler = _scheduler(system, fields)
    at_fault = _at_fault(fields)
    if not at_fault:
        assert (router, replica, scheduler) == (None, None, None), fields
        assert _engine(fields) == [], fields
    else:
        # Each refuses, naming a field at fault (with several at fault, each process may name another).
        assert router is not None and router.split(".")[0] in at_fault, (fields, router)
        assert replica is not None and replica.split(".")[0] in at_fault, (fields, replica)
        # Python refuses a wrongly typed value before any rule does in the offline API; HTTP names the field.
        assert scheduler == "type" or scheduler in at_fault, (fields, scheduler)
        engine = _engine(fields)
        for name in at_fault & set(_WIRE):
            v = fields.get(name)
            # The scheduler carries a value of its field's own kind unchanged (an integer field's 1.5 would
            # be int()-ed by Python, a refused value the scheduler never lets through in the first place).
            kind = int if L.RANGES[name].integer else (int, float)
            reaches_wire = isinstance(v, kind) and not isinstance(v, bool)
            min_p_dropped = name == "min_p" and _greedy_row(fields)
            if reaches_wire and not min_p_dropped:  # a value the engine can be sent: refused there too
                assert _WIRE[name] in engine or "type" in engine, (fields, engine)
    assert system["engine"].faults == [], system["engine"].faults


def test_every_ranged_field_is_generated():
    assert set(L.RANGES) <= set(FIELDS)


def test_the_temperature_floor_is_applied_once_where_a_request_becomes_a_step():
    params = SamplingParams(temperature=L.MIN_TEMPERATURE / 2)
    assert Sequence("r", PROMPT, params, 0).spec.temperature == 0.0
    # The engine refuses a temperature below the floor that did not come through the scheduler.
    step = SchedulerOutput(0, [ScheduledSequence("r", PROMPT, 0, [0], True,
                                                 Sequence("r", PROMPT, SamplingParams(), 0).spec)])
    step.sequences[0].sampling.temperature = L.MIN_TEMPERATURE / 2
    faults = find_faults(step, StepLimits(16, 4096, MAX_LEN, VOCAB))
    assert [f.field for f in faults] == ["sampling.temperature"]


@pytest.mark.parametrize("bound", sorted(L.RANGES.items()), ids=lambda kv: kv[0] if isinstance(kv, tuple) else "")
def test_pydantic_and_the_table_agree_on_every_edge(bound):
    from pydantic import TypeAdapter

    from services.openai_api.protocol import ranged

    name, rng = bound
    adapter = TypeAdapter(ranged(int if rng.integer else float, rng), config={"strict": True})
    for value in _edges(rng) + [math.nan, math.inf]:
        try:
            adapter.validate_python(value)
            ok = True
        except Exception:
            ok = False
        assert ok == rng.admits(value), (name, value)
