"""LoRA residency as a scheduling constraint, over a shadow engine: never more adapters in a step than
slots, every sequence's slot holds its adapter, requests of a resident adapter pass a blocked head but
the head is not starved, and the block-hash chains of different adapters never meet."""

from __future__ import annotations

import hashlib

from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from tests.scheduler.shadow_executor import ShadowExecutor


class LoraShadow(ShadowExecutor):
    """A shadow engine with `max_loras` slots that checks every step's adapter fields as the engine would."""

    def __init__(self, max_loras: int, **kw):
        super().__init__(**kw)
        self.info.max_loras, self.info.max_lora_rank = max_loras, 8
        self.known: set[str] = set()
        self.slot_holds: dict[int, str] = {}
        self.lora_steps: list[dict[str, int]] = []  # per step: seq_id -> slot

    def load_lora(self, path: str) -> dict:
        digest = hashlib.sha256(path.encode()).hexdigest()
        self.known.add(digest)
        return {"digest": digest, "rank": 8}

    def unload_lora(self, digest: str) -> None:
        self.known.discard(digest)

    def execute(self, out):
        slots = dict(out.lora_slots)
        assert len(slots) <= self.info.max_loras and all(d in self.known for d in slots.values())
        for s in out.sequences:
            assert s.lora_slot == -1 or s.lora_slot in slots
        self.slot_holds.update(slots)
        self.lora_steps.append({s.seq_id: s.lora_slot for s in out.sequences})
        return super().execute(out)


def _core(tokenizer, max_loras=1, budget=64, num_blocks=128):
    ex = LoraShadow(max_loras, num_blocks=num_blocks, block_size=4)
    core = SchedulerCore(ex, tokenizer, max_num_seqs=8, max_num_batched_tokens=budget)
    ex.lookup = lambda seq_id: next(r.token_ids for r in core.scheduler.running if r.seq_id == seq_id)
    for name in ("A", "B", "C"):
        core.load_lora(name, f"/adapters/{name}")
    return core, ex


def _run(core):
    done = {}
    while core.has_unfinished():
        for o in core.step():
            if o.finished:
                done[o.request_id] = o
        core.pool.check_invariants()
    return done


def _greedy(n=6):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_one_slot_never_mixes_adapters_and_serves_everyone(tokenizer):
    core, ex = _core(tokenizer, max_loras=1)
    names = ["A", "B", None, "A", "C", "B", None, "A"]
    for i, name in enumerate(names):
        core.add_request(f"r{i}", [10 + i, 11, 12, 13, 14], _greedy(), lora_name=name)
    done = _run(core)
    assert len(done) == len(names) and all(o.error is None for o in done.values())
    by_seq = dict(enumerate(names))
    for step in ex.lora_steps:
        adapters = {by_seq[int(sid[1:])] for sid, slot in step.items() if slot >= 0}
        assert len(adapters) <= 1, step


def test_requests_of_a_resident_adapter_pass_a_blocked_head(tokenizer):
    core, ex = _core(tokenizer, max_loras=1)
    core.add_request("a0", [1, 2, 3, 4, 5], _greedy(20), lora_name="A")
    core.step()
    core.add_request("b0", [6, 7, 8, 9], _greedy(), lora_name="B")  # no slot while a0 runs
    core.add_request("a1", [9, 8, 7, 6], _greedy(), lora_name="A")
    core.add_request("base", [5, 5, 5, 5], _greedy())
    core.step()
    running = {r.seq_id for r in core.scheduler.running}
    assert {"a0", "a1", "base"} <= running and "b0" not in running
    done = _run(core)
    assert done["b0"].error is None and len(done["b0"].outputs[0].token_ids) == 6


def test_a_blocked_head_is_not_starved(tokenizer):
    core, ex = _core(tokenizer, max_loras=1)
    core.add_request("a0", [1, 2, 3, 4, 5], _greedy(8), lora_name="A")
    core.step()
    core.add_request("b0", [6, 7, 8, 9], _greedy(), lora_name="B")
    steps, i = 0, 0
    while "b0" not in {r.seq_id for r in core.scheduler.running}:
        core.add_request(f"a{i + 1}", [20 + i % 50, 1, 2, 3], _greedy(8), lora_name="A")  # a steady stream of A
        i += 1
        core.step()
        steps += 1
        assert steps < 200, "B never got the slot"
    _run(core)


def test_chains_are_rooted_in_the_adapter_content(tokenizer):
    core, ex = _core(tokenizer, max_loras=2)
    prompt = list(range(100, 140))
    core.load_lora("A2", "/adapters/A")  # same files as A under another name
    outs = {}
    for name in ("A", "B", "A", "A2", None):
        core.add_request(f"q-{len(outs)}", prompt, _greedy(2), lora_name=name)
        outs[len(outs)] = (name, _run(core)[f"q-{len(outs)}"].num_cached_tokens)
    cached = [c for _, c in outs.values()]
    assert cached[0] == 0 and cached[1] == 0, "B never hits A's blocks"
    assert cached[2] > 0 and cached[3] > 0, "A again, and the same files under another name, hit"
    assert cached[4] == 0, "the base model never hits an adapter's blocks"
