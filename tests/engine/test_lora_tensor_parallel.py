"""LoRA adapters under tensor parallelism, sharded as vLLM shards them.

Each rank's slices of an adapter, applied to its part of each projection, give exactly its part of the
whole delta (column-parallel: its output columns; row-parallel: a partial sum that the ranks' sum
completes), for every head layout a model can be split by (hypothesis), replicated KV heads included.
Through the offline API at 3 ranks (rank 0 here, two `engine-worker` processes over gloo, float32, a
model shaped like SmolLM2: 9 heads over 3 KV heads, one KV head per rank): adapters loaded at run time
reach every rank, and a mixed greedy batch of base, A and B requests with chunked prefill, prefix hits
and preemption is token-identical to one rank and to PEFT + transformers; an adapter loaded after
those requests serves its own; an unloaded one is refused; with one slot and one adapter in host
memory, every switch re-reads an adapter on rank 0 and sends it to every rank, still token-identical;
a bad adapter or a bad step is refused on rank 0 and the group serves on."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from services import LLM, InvalidRequestError
from services.contracts.step_protocol import InvalidStepError, SamplingSpec, ScheduledSequence, SchedulerOutput
from services.engine.lora.batch import LoraBatch
from services.engine.lora.commands import LoraCommand, decode, encode
from services.engine.lora.slots import LoraSlots
from services.engine.lora.weights import load_weights, module_dims
from services.engine.tp_shard import TensorParallelShard
from services.model_files.lora_files import TARGET_MODULES, AdapterError, AdapterFiles, TensorInfo, tensor_key
from tests.engine.conftest import make_tiny_model
from tests.engine.lora_adapters import peft_greedy, peft_model, save_random_adapter
from tests.engine.test_lora import GREEDY, _prompts


def _adapter_files(config, rank: int, seed: int) -> AdapterFiles:
    """A rank-`rank` adapter on every projection of `config`'s first layer, as checked files."""
    gen = torch.Generator().manual_seed(seed)
    tensors, infos = {}, {}
    for module, (fan_in, fan_out) in module_dims(config).items():
        for kind, shape in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
            key = tensor_key(0, module, kind)
            tensors[key] = torch.randn(shape, generator=gen, dtype=torch.float64)
            infos[key] = TensorInfo(0, module, kind, "F64", shape)
    return AdapterFiles("/adapter", f"{seed:064x}", rank, 2.0 * rank, False, TARGET_MODULES, infos,
                        save_safetensors(tensors))


def _deltas(config, files: AdapterFiles, shard, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What this rank's slots add to each fused projection's output for the inputs `xs` (its own part
    of the input for o and down)."""
    slots = LoraSlots(config, shard, 1, files.rank, torch.float64, torch.device("cpu"), 1)
    slots.add(load_weights(files, config, torch.float64, shard), files.path)
    slots.activate(0, files.digest)
    batch = LoraBatch.of(slots, [(0, 0, 3)], torch.device("cpu"))
    out = {}
    for group, x in xs.items():
        out[group] = torch.zeros(3, slots.b[0][group].shape[0], dtype=torch.float64)
        batch.apply(0, group, x, out[group])
    return out


@st.composite
def layouts(draw):
    kv = draw(st.sampled_from([1, 2, 3]))
    heads = kv * draw(st.integers(1, 3))
    size = draw(st.sampled_from([n for n in range(2, 7) if heads % n == 0 and (kv % n == 0 or n % kv == 0)] or [1]))
    return heads, kv, size, draw(st.integers(1, 4))


@settings(max_examples=25, deadline=None)
@given(layouts())
def test_each_rank_adds_its_part_of_the_delta(layout):
    heads, kv, size, per_rank = layout
    head_dim = 4
    config = types.SimpleNamespace(hidden_size=12, head_dim=head_dim, num_heads=heads, num_kv_heads=kv,
                                   intermediate_size=size * per_rank * 2, num_layers=1)
    files = _adapter_files(config, rank=3, seed=heads * 100 + kv * 10 + size)
    gen = torch.Generator().manual_seed(size)
    hidden, q_width = (torch.randn(3, n, generator=gen, dtype=torch.float64)
                       for n in (config.hidden_size, heads * head_dim))
    inter = torch.randn(3, config.intermediate_size, generator=gen, dtype=torch.float64)
    whole = _deltas(config, files, None, {"qkv": hidden, "o": q_width, "gate_up": hidden, "down": inter})
    q, kv_width, mlp = heads * head_dim, kv * head_dim, config.intermediate_size
    o_sum, down_sum = 0, 0
    for r in range(size):
        s = TensorParallelShard.plan(num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                                     intermediate=mlp, vocab_size=8, size=size, rank=r)
        (q0, q1), (k0, k1), (m0, m1) = s.q_rows, s.kv_rows, s.mlp_rows
        mine = _deltas(config, files, s, {"qkv": hidden, "o": q_width[:, q0:q1], "gate_up": hidden,
                                          "down": inter[:, m0:m1]})
        want_qkv = torch.cat([whole["qkv"][:, q0:q1], whole["qkv"][:, q + k0:q + k1],
                              whole["qkv"][:, q + kv_width + k0:q + kv_width + k1]], dim=1)
        torch.testing.assert_close(mine["qkv"], want_qkv, rtol=0, atol=1e-12)
        want_gate_up = torch.cat([whole["gate_up"][:, m0:m1], whole["gate_up"][:, mlp + m0:mlp + m1]], dim=1)
        torch.testing.assert_close(mine["gate_up"], want_gate_up, rtol=0, atol=1e-12)
        o_sum, down_sum = o_sum + mine["o"], down_sum + mine["down"]
    torch.testing.assert_close(o_sum, whole["o"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(down_sum, whole["down"], rtol=1e-12, atol=1e-12)


def test_commands_round_trip_with_the_checked_bytes():
    config = types.SimpleNamespace(hidden_size=8, head_dim=4, num_heads=2, num_kv_heads=1, intermediate_size=8,
                                   num_layers=1)
    a, b = _adapter_files(config, 2, 1), _adapter_files(config, 4, 2)
    cmds = [LoraCommand("add", a.digest, "/a", files=a), LoraCommand("activate", a.digest, slot=1),
            LoraCommand("add", b.digest, "/b", files=b), LoraCommand("forget", a.digest)]
    assert decode(encode(cmds)) == cmds
    with pytest.raises(ValueError, match="bytes"):
        decode(encode(cmds) + b"\0")


# SmolLM2's head layout at a tiny width: 9 heads over 3 KV heads, so 3 heads and 1 KV head per rank.
SMOLLM2_SHAPE = dict(hidden_size=72, intermediate_size=96, num_attention_heads=9, num_key_value_heads=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp3") / "llama", **SMOLLM2_SHAPE)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp3-adapters")
    return {"A": save_random_adapter(model_dir, root / "A", seed=1),
            "B": save_random_adapter(model_dir, root / "B", seed=2, alpha=32, use_rslora=True),
            "C": save_random_adapter(model_dir, root / "C", seed=3, rank=4)}


@pytest.fixture(scope="module")
def reference(model_dir, adapters):
    return peft_model(model_dir, adapters)


def test_mixed_batch_at_three_ranks_equals_one_rank_and_peft(model_dir, adapters, reference):
    kwargs = dict(model=str(model_dir), dtype="float32", num_kv_blocks=40, max_num_batched_tokens=48, max_loras=2,
                  max_lora_rank=8)
    prompts, names = _prompts(9), [None, "A", "B"] * 3

    def run(llm):
        for name in ("A", "B"):
            llm.load_lora(name, str(adapters[name]))
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=names)
        stats = llm.core.scheduler.num_preemptions, llm.core.kv.prefix_hits
        assert stats[0] > 0 and stats[1] > 0, f"preemptions, prefix-hit tokens: {stats}"
        return [o.outputs[0].token_ids for o in outs]

    one = run(LLM(**kwargs))
    with LLM(**kwargs, tensor_parallel_size=3) as llm:
        three = run(llm)
        # Loaded at run time after those requests: C (rank 4) reaches every rank and serves its own tokens.
        llm.load_lora("C", str(adapters["C"]))
        late = llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request="C")
        digest_a = llm.core.loras.get("A").digest
        llm.unload_lora("A")
        with pytest.raises(InvalidRequestError, match="lora_request"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request="A")
        assert not llm.runner.lora.knows(digest_a), "nothing in flight holds A: every rank forgets it"
        after = llm.generate(prompts[:3], GREEDY, use_tqdm=False, lora_request=[None, "B", "C"])
    for p, name, got, want in zip(prompts, names, three, one, strict=True):
        assert got == want, f"adapter {name}: 3 ranks differ from 1 on a prompt of {len(p)} tokens"
        assert want == peft_greedy(reference, name, p, GREEDY.max_tokens), f"adapter {name} differs from PEFT"
    for p, o in zip(prompts[:2], late, strict=True):
        assert o.outputs[0].token_ids == peft_greedy(reference, "C", p, GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in after] == [three[0], peft_greedy(reference, "B", prompts[1], 12),
                                                       peft_greedy(reference, "C", prompts[2], 12)]
    assert len({tuple(t) for t in three[:3]}) == 3, "the adapters must change the output"


def test_one_slot_switching_adapters_at_three_ranks(model_dir, adapters, reference, tiny_model_dir, tmp_path):
    """One slot and one adapter kept in host memory: each switch reads the adapter's files again on rank
    0 and sends them to the other ranks; their slots must follow rank 0's exactly. An adapter of another
    model's shapes and a step naming a bad slot are refused on rank 0 before any rank changes: the group
    serves on."""
    prompts = _prompts(4)
    names = ["A", "B", "A", "B"]
    other = save_random_adapter(tiny_model_dir, tmp_path / "other", seed=5)
    with LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_loras=1, max_cpu_loras=1,
             max_lora_rank=8, tensor_parallel_size=3) as llm:
        for name in ("A", "B"):
            llm.load_lora(name, str(adapters[name]))
        with pytest.raises(AdapterError, match="does not fit the model"):
            llm.load_lora("other", str(other))
        seq = ScheduledSequence("s1", [5, 6, 7], 0, [0], True, SamplingSpec(), lora_slot=0)
        with pytest.raises(InvalidStepError) as e:
            llm.runner.execute(SchedulerOutput(1, [seq], lora_slots=[(0, "f" * 64)]))
        assert e.value.faults[0].field == "lora_slot"
        outs = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=n)[0]
                for p, n in zip(prompts, names, strict=True)]
        assert llm.runner.lora.slots.max_cpu_loras == 1 and len(llm.runner.lora.slots.host) == 1
    for p, name, o in zip(prompts, names, outs, strict=True):
        assert o.outputs[0].token_ids == peft_greedy(reference, name, p, GREEDY.max_tokens), name
