"""What the GPU check runs (services/device_check/run.py, gpu_check_tp.py): the plan of shapes, sizes and
time budgets on a GPU and in the CPU dry run, and the synthetic engine workloads it times (ModelRunner
driven by services/device_check/step_driver.py, no scheduler)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LLAMA_3_2_1B = dict(
    _name_or_path="Llama-3.2-1B (random weights)", architectures=["LlamaForCausalLM"], hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}, tie_word_embeddings=True)
LLAMA_3_1_8B = dict(
    LLAMA_3_2_1B, _name_or_path="Llama-3.1-8B (random weights)", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, head_dim=128, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192})
TINY_LLAMA = dict(
    _name_or_path="tiny Llama (random weights)", architectures=["LlamaForCausalLM"], hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True)


@dataclass(frozen=True)
class Plan:
    """What one run measures: the real shapes on a GPU, or tiny ones for the dry run."""

    dtype: str
    models: dict
    check_shapes: tuple
    check_max_len: int | None
    goal: tuple  # (BenchShape kwargs, batch, context)
    batches: tuple[int, ...]
    prompt_len: int
    warmup_steps: int
    decode_steps: int
    prefill_tokens: int
    prefill_budget: int
    reps: int
    max_model_len: int
    kernel_dtypes: tuple[str, ...]  # the kernels are checked against their references in each
    budgets: dict = field(default_factory=dict)  # section -> seconds; a model's sections: "engine", "tp"
    run_budget_s: float = 420.0  # the whole run, start-up excluded (8 minutes on one H200 with it)

    def budget(self, section: str) -> float:
        return self.budgets[section]


GPU_PLAN = Plan(dtype="bfloat16", models={"Llama-3.2-1B": LLAMA_3_2_1B, "Llama-3.1-8B": LLAMA_3_1_8B},
                check_shapes=((32, 8, 128, 16), (9, 3, 64, 32), (8, 8, 64, 16)), check_max_len=None,
                goal=({}, 64, 4096), batches=(1, 32, 256), prompt_len=512, warmup_steps=3, decode_steps=32,
                prefill_tokens=2048, prefill_budget=8192, reps=30, max_model_len=8192,
                kernel_dtypes=("bfloat16", "float16"),
                # Estimates until a device run replaces them: Triton compiles ~1 s a variant, the 8B's random
                # weights (16 GB) and its graphs (9 batch sizes) take the longest.
                budgets={"kernels bfloat16": 40, "kernels float16": 40, "decode bandwidth": 25,
                         "engine correctness": 70, "Llama-3.2-1B": 90, "Llama-3.1-8B": 130, "tp": 200})
DRY_PLAN = Plan(dtype="float32", models={"tiny-llama": TINY_LLAMA}, check_shapes=((4, 2, 16, 16), (6, 2, 32, 16)),
                check_max_len=80, goal=(dict(hq=4, hkv=2, head_dim=16, block_size=16), 2, 64), batches=(1, 2, 4),
                prompt_len=16, warmup_steps=1, decode_steps=3, prefill_tokens=48, prefill_budget=64, reps=3,
                max_model_len=256, kernel_dtypes=("float32", "float16"),
                # The interpreter on two shared cores: generous, only a hang should reach them.
                budgets={"kernels float32": 300, "kernels float16": 300, "decode bandwidth": 120,
                         "engine correctness": 600, "tiny-llama": 600, "tp": 600}, run_budget_s=3600)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_tokens_per_s(runner, batch: int, plan: Plan, seed: int) -> float:
    import random

    from services.device_check.step_driver import StepDriver

    rng = random.Random(seed)
    vocab = runner.info.vocab_size
    d = StepDriver(runner)
    for i in range(batch):
        d.add(f"s{i}", [rng.randrange(vocab) for _ in range(plan.prompt_len)])
    d.prefill(plan.prefill_budget)
    for _ in range(plan.warmup_steps):
        d.step()
    sync(runner.device)
    start = time.perf_counter()
    for _ in range(plan.decode_steps):
        d.step()
    sync(runner.device)
    return batch * plan.decode_steps / (time.perf_counter() - start)


def prefill_tokens_per_s(runner, plan: Plan) -> float:
    import random
    import statistics

    from services.device_check.step_driver import StepDriver

    rng = random.Random(1)
    times = []
    for rep in range(3):
        d = StepDriver(runner)
        d.add(f"p{rep}", [rng.randrange(runner.info.vocab_size) for _ in range(plan.prefill_tokens)])
        sync(runner.device)
        start = time.perf_counter()
        d.step()
        sync(runner.device)
        times.append(time.perf_counter() - start)
    return plan.prefill_tokens / statistics.median(times[1:])
