"""No Triton compile while serving, proven without a GPU: Triton keys its compiled variants on the
specialization of each launch's arguments (constexprs, dtypes, pointers' 16-byte alignment, integers equal
to 1 or divisible by 16, launch options). Here the engine runs through the interpreter, every launch's
arguments are recorded, and their keys are computed with Triton's own binder for a Hopper target: the
keys of a varied run of steps (batch sizes, chunk sizes, mixed steps, split-KV decodes) must all be among
those the start-up warm-up launched."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")
jit_module = pytest.importorskip("triton.runtime.jit")

from kernels.triton_variants import engine_kernels  # noqa: E402
from services.device_check.step_driver import StepDriver  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.kernel_warmup import warm_up  # noqa: E402
from services.engine.model_runner import ModelRunner  # noqa: E402

CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=1024, tie_word_embeddings=True)


def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))  # an H100/H200; no GPU needed to build it


class SignatureRecorder:
    """Replaces each engine kernel's launch by a record of the specialization key Triton would compile
    under (the launchers, their arguments and the engine around them are the real ones)."""

    def __init__(self, monkeypatch):
        self.keys: set[tuple] = set()
        self.launches = 0
        backend = _backend()
        for name, kernel in engine_kernels().items():
            # The same function and decorator options (do_not_specialize...) as a compiled JITFunction.
            jit = jit_module.JITFunction(kernel.fn, **kernel.kwargs)
            binder = jit_module.create_function_from_signature(jit.signature, jit.params, backend)
            monkeypatch.setattr(kernel, "run", self._recording(name, binder))

    def _recording(self, name, binder):
        def recorded(*args, grid, warmup, **kwargs):
            _, specialization, options = binder(*args, **kwargs)
            self.keys.add((name, str(specialization), str(sorted(options.items()))))
            self.launches += 1
            # The key depends only on the arguments: running the kernel through the interpreter would cost
            # minutes and change no key (the outputs are never-written buffers; the steps are host-built).
            return None

        return recorded


def varied_run(runner, seed: int) -> None:
    """Steps of every kind the scheduler sends: batches of 1..6, prompts of 2..150 tokens in chunks of
    varied size, sequences joining mid-decode (mixed steps) and one long enough for split-KV decode."""
    rng = random.Random(seed)
    d = StepDriver(runner)
    vocab = runner.info.vocab_size
    for i in range(3):
        d.add(f"a{i}", [rng.randrange(vocab) for _ in range(rng.randrange(2, 150))])
    d.prefill(rng.choice((17, 64, 200)))
    for step in range(6):
        if step in (1, 3):
            d.add(f"b{step}", [rng.randrange(vocab) for _ in range(rng.randrange(2, 90))])
        d.step({s: rng.randrange(1, 40) for s in d.seqs})
    d.add("long", [rng.randrange(vocab) for _ in range(560)])
    d.step({s: (560 if s == "long" else 0) for s in d.seqs})
    for _ in range(2):
        d.step({s: (1 if s == "long" else 0) for s in d.seqs})  # the long one decodes alone: split KV


def test_a_varied_run_compiles_nothing_past_the_warm_up(monkeypatch):
    config = EngineConfig(dtype="float32", device="cpu", block_size=16, num_kv_blocks=256, max_model_len=1024,
                          attention_backend="triton", enforce_eager=True, max_num_seqs=8)
    runner = ModelRunner(config, random_weights=CONFIG)
    recorder = SignatureRecorder(monkeypatch)
    warm_up(runner)
    warmed = set(recorder.keys)
    kinds = {name for name, _, _ in warmed}
    assert kinds == {"decode", "decode reduce", "prefill", "write_kv"}, kinds
    assert len(warmed) <= 6, sorted(warmed)  # split/unsplit decode, reduce, prefill 64/128 rows, write_kv
    assert not runner.arena.any(), "the warm-up leaves the KV cache clear"

    recorder.keys.clear()
    before = recorder.launches
    with torch.inference_mode():
        varied_run(runner, seed=3)
    assert recorder.launches - before > 30
    new = recorder.keys - warmed
    assert not new, f"{len(new)} kernel variants would compile while serving: {sorted(new)[:3]}"


def test_unaligned_fields_would_compile_new_variants(monkeypatch):
    """The proof has teeth: with the step buffer's fields packed back to back (FIELD_ALIGN 4), the same
    run launches index tensors whose alignment differs from the warm-up's."""
    import services.engine.step_layout as step_layout

    monkeypatch.setattr(step_layout, "FIELD_ALIGN", 4)
    config = EngineConfig(dtype="float32", device="cpu", block_size=16, num_kv_blocks=256, max_model_len=1024,
                          attention_backend="triton", enforce_eager=True, max_num_seqs=8)
    runner = ModelRunner(config, random_weights=CONFIG)
    recorder = SignatureRecorder(monkeypatch)
    warm_up(runner)
    warmed = set(recorder.keys)
    with torch.inference_mode():
        varied_run(runner, seed=3)
    assert recorder.keys - warmed
