"""How far a half-precision engine's logits lie from the float32 reference of the same weights, measured
on the CPU: what the GPU check's LOGIT_BOUND for bfloat16 and float16 is set from
(`python -m services.device_check.logit_error --model Llama-3.2-1B --dtype bfloat16`).

The same comparison as the GPU check's correctness section (services/device_check/correctness.py: the
reference's greedy tokens fed to the tested engine, every logits row compared as a fraction of the
reference row's RMS), with the tested engine on the PyTorch reference backend in the half dtype instead
of Triton (the interpreter cannot run a bfloat16 tl.dot). It measures the rounding of half-precision
activations and weights through the model's depth, which the Triton kernels share (they accumulate in
float32, as torch does).
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from services.device_check.correctness import _greedy, compare, reference_runner
    from services.device_check.workload import DRY_PLAN, GPU_PLAN
    from services.engine.config import EngineConfig
    from services.engine.model_runner import ModelRunner

    models = {**GPU_PLAN.models, **DRY_PLAN.models}
    p = argparse.ArgumentParser(prog="python -m services.device_check.logit_error", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Llama-3.2-1B", choices=sorted(models))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--sequences", type=int, default=2)
    args = p.parse_args(argv)
    hf_cfg = models[args.model]
    plan = type(GPU_PLAN)(**{**GPU_PLAN.__dict__, "dtype": args.dtype, "max_model_len": 1024})
    rng = random.Random(7)
    prompts = {f"g{i}": [rng.randrange(hf_cfg["vocab_size"]) for _ in range(args.prompt_len + 9 * i)]
               for i in range(args.sequences)}
    blocks = args.sequences * -(-(args.prompt_len + 9 * args.sequences + args.steps + 16) // 16) + 4
    started = time.monotonic()
    import torch

    cpu = torch.device("cpu")
    reference = reference_runner(plan, cpu, hf_cfg, blocks)
    ref = _greedy(reference, prompts, args.steps, 0)
    del reference
    config = EngineConfig(dtype=args.dtype, device="cpu", block_size=16, num_kv_blocks=blocks, max_model_len=1024,
                          attention_backend="reference", enforce_eager=True, max_num_seqs=8)
    tested = ModelRunner(config, random_weights=hf_cfg)
    a = compare(ref, _greedy(tested, prompts, args.steps, 0, forced=ref), bound=float("inf"))
    print(f"{args.model} (random weights), {args.dtype} on the PyTorch reference backend against float32, same "
          f"weights: {a.describe(float('inf'))}; {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
