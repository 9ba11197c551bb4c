"""The GPU check's tensor-parallel section (`python -m services.device_check.run --tensor-parallel-size N`):
one engine split over N GPUs of this machine, driven like the single-GPU section (synthetic steps, no
scheduler), on random weights in the plan's model shapes (each rank draws its own shard; no download).

Per model: start-up of the group, decode tokens/s at the plan's batches eagerly and replayed from CUDA
graphs captured on every rank (their all-reduces inside the graphs), prefill tokens/s, that graph
replay gives the eager tokens, each rank's weights and KV cache and rank 0's peak device memory. A
machine with fewer GPUs than N gets one row saying so, not a crash. `--device cpu --dry-run` runs the
same code with gloo ranks at tiny shapes, eagerly only (its child ranks have no fake graph capture).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from services.device_check.report import Report
from services.device_check.workload import Plan, decode_tokens_per_s, prefill_tokens_per_s


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _probe_tokens(runner, steps: int = 4) -> dict[str, list[int]]:
    from services.device_check.step_driver import StepDriver

    d = StepDriver(runner)
    for i in range(3):
        d.add(f"g{i}", [(97 * i + 13 * j) % runner.info.vocab_size for j in range(20 + 9 * i)])
    for _ in range(steps + 1):
        d.step()
    return {k: s.samples for k, s in d.seqs.items()}


def check_tensor_parallel(report: Report, plan: Plan, device, name: str, hf_cfg: dict, tp: int) -> None:
    import torch

    from services.engine.config import EngineConfig
    from services.engine.tp_launch import start_runner

    section = f"{name} TP={tp}"
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        report.add(section, "tensor parallel", "-", f"needs {tp} GPUs; {torch.cuda.device_count()} visible: "
                   "run it on a machine with more")
        return
    need = max(plan.batches) * -(-(plan.prompt_len + plan.warmup_steps + plan.decode_steps + 1) // 16)
    modes = [("eager", True)] + ([("CUDA graphs", False)] if device.type == "cuda" else [])
    tokens = {}
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(hf_cfg))
        base = EngineConfig(model=model_dir, load_format="random", dtype=plan.dtype, device=device.type,
                            block_size=16, num_kv_blocks=need + 64, max_model_len=plan.max_model_len,
                            attention_backend="triton", max_num_seqs=max(plan.batches), tensor_parallel_size=tp)
        for label, eager in modes:
            if report.out_of_time(f"{section} {label}"):
                return
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            started = time.monotonic()
            runner = start_runner(dataclasses.replace(base, enforce_eager=eager))
            try:
                report.add(section, f"start-up of {tp} ranks, {label}", f"{time.monotonic() - started:.1f} s")
                for batch in plan.batches:
                    if report.out_of_time(f"{section} {label} decode batch {batch}"):
                        break
                    tps = decode_tokens_per_s(runner, batch, plan, seed=batch)
                    report.add(section, f"decode batch {batch}, {label}", f"{tps:.0f} tok/s", tokens_per_s=tps)
                if eager and not report.out_of_time(f"{section} prefill"):
                    tps = prefill_tokens_per_s(runner, plan)
                    report.add(section, f"prefill {plan.prefill_tokens} tokens", f"{tps:.0f} tok/s", tokens_per_s=tps)
                tokens[label] = _probe_tokens(runner)
                if eager:
                    for m in runner.memory:
                        report.add(section, f"rank {m.rank} weights + KV cache",
                                   _size(m.weight_bytes + m.kv_cache_bytes), f"weights {_size(m.weight_bytes)}",
                                   **dataclasses.asdict(m))
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device)
                    report.add(section, f"rank 0 peak memory allocated, {label}", f"{peak / 2**30:.1f} GiB",
                               peak_bytes=peak)
            finally:
                runner.close()
    if len(tokens) == 2:
        same = tokens["eager"] == tokens["CUDA graphs"]
        report.add(section, "greedy tokens: graph replay == eager", "yes" if same else "NO")
        if not same:
            report.fail(f"{section}: graph replay differs from eager")
