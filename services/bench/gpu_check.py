"""The device check of the GPU engine path: `python -m services.bench.gpu_check` (`make gpu-check`).

One run on one GPU, under ten minutes, no network and no download (random weights in the real shapes
of Llama-3.2-1B and Llama-3.1-8B, bfloat16). Prints one table (and `--json`):

1. the Triton kernels against the PyTorch references (max abs and relative error);
2. decode attention at batch 64, context 4096, 32 query / 8 KV heads, head dim 128, block 16: achieved
   bandwidth against the measured copy bandwidth (goal >= 80%) and against torch's
   scaled_dot_product_attention on contiguous KV (the roofline stand-in);
3. per model, the engine alone (ModelRunner, synthetic steps, no scheduler): decode tokens/s at batch
   1, 32 and 256, eager and replayed from CUDA graphs, graph capture time, prefill tokens/s at 2,048
   tokens, that the forward makes no host sync (torch.cuda.set_sync_debug_mode("error")), peak memory
   and the KV blocks allocated; with `--tensor-parallel-size N`, the same engine split over N GPUs
   instead (services/bench/gpu_check_tp.py).

`--device cpu --dry-run` runs the same code at tiny shapes through Triton's interpreter and a fake
graph capture (make test does, so this script cannot rot without a GPU). It lives in services.bench,
not kernels, because it drives the engine (kernels may not import services: docs/architecture.md);
the kernel measurements are kernels.bench's own functions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

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


GPU_PLAN = Plan(dtype="bfloat16", models={"Llama-3.2-1B": LLAMA_3_2_1B, "Llama-3.1-8B": LLAMA_3_1_8B},
                check_shapes=((32, 8, 128, 16), (9, 3, 64, 32), (8, 8, 64, 16)), check_max_len=None,
                goal=({}, 64, 4096), batches=(1, 32, 256), prompt_len=512, warmup_steps=3, decode_steps=32,
                prefill_tokens=2048, prefill_budget=8192, reps=30, max_model_len=8192)
DRY_PLAN = Plan(dtype="float32", models={"tiny-llama": TINY_LLAMA}, check_shapes=((4, 2, 16, 16), (6, 2, 32, 16)),
                check_max_len=80, goal=(dict(hq=4, hkv=2, head_dim=16, block_size=16), 2, 64), batches=(1, 2, 4),
                prompt_len=16, warmup_steps=1, decode_steps=3, prefill_tokens=48, prefill_budget=64, reps=3,
                max_model_len=256)


@dataclass
class Row:
    section: str
    item: str
    value: str
    note: str = ""
    data: dict = field(default_factory=dict)


class Report:
    def __init__(self, budget_s: float):
        self.rows: list[Row] = []
        self.deadline = time.monotonic() + budget_s
        self.failures: list[str] = []

    def add(self, section: str, item: str, value: str, note: str = "", **data) -> None:
        row = Row(section, item, value, note, data)
        self.rows.append(row)
        print(f"  {section:9s} {item:44s} {value:>16s}  {note}", flush=True)

    def out_of_time(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.add("skipped", what, "-", "time budget spent")
        return True

    def print_table(self) -> None:
        widths = [max(len(getattr(r, f)) for r in self.rows) for f in ("section", "item", "value")]
        print("\n| " + " | ".join(("section".ljust(widths[0]), "check".ljust(widths[1]),
                                   "result".rjust(widths[2]), "note")) + " |")
        print("|" + "|".join("-" * (w + 2) for w in [*widths, 4]) + "|")
        for r in self.rows:
            print(f"| {r.section.ljust(widths[0])} | {r.item.ljust(widths[1])} | {r.value.rjust(widths[2])} | "
                  f"{r.note} |")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_kernels(report: Report, plan: Plan, device) -> None:
    import torch

    from kernels.bench import check_correctness

    dtype = getattr(torch, plan.dtype)
    for r in check_correctness(device, dtype, plan.check_shapes, plan.check_max_len):
        report.add("kernels", r["name"], f"{r['max_abs_err']:.2e}",
                   f"max abs err; rel {r['rel_err']:.1e}" + ("" if r["ok"] else "  FAIL"), **r)
        if not r["ok"]:
            report.failures.append(r["name"])


def check_bandwidth(report: Report, plan: Plan, device) -> None:
    from kernels.bench import GOAL_FRACTION, BenchShape, bench_decode, bench_sdpa_decode
    from kernels.bench_timing import copy_bandwidth

    copy_bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (16 << 20))
    report.add("bandwidth", "device copy (read + write)", f"{copy_bw / 1e9:.0f} GB/s", bandwidth=copy_bw)
    shape_kw, batch, ctx = plan.goal
    shape = BenchShape(**shape_kw, **({} if device.type == "cuda" else {"dtype": _dtype(plan)}))
    ours = bench_decode(batch, ctx, device, plan.reps, shape)
    sdpa = bench_sdpa_decode(batch, ctx, device, plan.reps, shape)
    label = f"B={batch} ctx={ctx} {shape.hq}q/{shape.hkv}kv d={shape.head_dim} bs={shape.block_size}"
    if ours is None or sdpa is None:
        report.add("bandwidth", f"decode {label}", "-", "does not fit in memory")
        return
    bw = ours["kv_bytes"] / (ours["ms"] * 1e-3)
    fraction = bw / copy_bw
    met = "MET" if fraction >= GOAL_FRACTION else "NOT MET"
    report.add("bandwidth", f"paged decode {label}", f"{bw / 1e9:.0f} GB/s",
               f"{fraction:.1%} of copy (goal >= {GOAL_FRACTION:.0%}: {met}); {ours['ms'] * 1e3:.1f} us, "
               f"rel err {ours['rel_err']:.1e}", **ours)
    sdpa_bw = sdpa["kv_bytes"] / (sdpa["ms"] * 1e-3)
    report.add("bandwidth", "SDPA on contiguous KV, same shape", f"{sdpa_bw / 1e9:.0f} GB/s",
               f"{sdpa['ms'] * 1e3:.1f} us; paged decode takes {ours['ms'] / sdpa['ms']:.2f}x its time", **sdpa)


def _dtype(plan: Plan):
    import torch

    return getattr(torch, plan.dtype)


def decode_tokens_per_s(runner, batch: int, plan: Plan, seed: int) -> float:
    import random

    from services.bench.step_driver import StepDriver

    rng = random.Random(seed)
    vocab = runner.info.vocab_size
    d = StepDriver(runner)
    for i in range(batch):
        d.add(f"s{i}", [rng.randrange(vocab) for _ in range(plan.prompt_len)])
    d.prefill(plan.prefill_budget)
    for _ in range(plan.warmup_steps):
        d.step()
    _sync(runner.device)
    start = time.perf_counter()
    for _ in range(plan.decode_steps):
        d.step()
    _sync(runner.device)
    return batch * plan.decode_steps / (time.perf_counter() - start)


def prefill_tokens_per_s(runner, plan: Plan) -> float:
    import random
    import statistics

    from services.bench.step_driver import StepDriver

    rng = random.Random(1)
    times = []
    for rep in range(3):
        d = StepDriver(runner)
        d.add(f"p{rep}", [rng.randrange(runner.info.vocab_size) for _ in range(plan.prefill_tokens)])
        _sync(runner.device)
        start = time.perf_counter()
        d.step()
        _sync(runner.device)
        times.append(time.perf_counter() - start)
    return plan.prefill_tokens / statistics.median(times[1:])


def forward_host_syncs(runner, plan: Plan) -> str:
    """Run a mixed eager step (prefills beside decodes) with CUDA's sync debug mode set to error."""
    import random

    import torch

    from services.bench.step_driver import StepDriver

    if runner.device.type != "cuda":
        return "not checked here (the CPU proof: tests/engine/test_attention.py)"
    forward = runner.model.forward

    def guarded(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    rng = random.Random(2)
    graphs, runner.graphs = runner.graphs, None
    runner.model.forward = guarded
    try:
        d = StepDriver(runner)
        for i in range(4):
            d.add(f"m{i}", [rng.randrange(runner.info.vocab_size) for _ in range(40 + 30 * i)])
        d.step({"m0": 40, "m1": 70, "m2": 0, "m3": 0})
        d.step()  # decodes m0, m1 beside the prefills of m2, m3
        d.step()
        return "none"
    except RuntimeError as e:
        return f"SYNC: {str(e).splitlines()[0]}"
    finally:
        del runner.model.forward
        runner.graphs = graphs


def check_engine(report: Report, plan: Plan, device, name: str, hf_cfg: dict) -> None:
    import torch

    from services.engine.config import EngineConfig
    from services.engine.cuda_graphs import FakeGraphCapture
    from services.engine.model_runner import ModelRunner

    need = max(plan.batches) * -(-(plan.prompt_len + plan.warmup_steps + plan.decode_steps + 1) // 16)
    config = EngineConfig(dtype=plan.dtype, device=device.type, block_size=16, num_kv_blocks=need + 64,
                          max_model_len=plan.max_model_len, attention_backend="triton", enforce_eager=True,
                          max_num_seqs=max(plan.batches))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.monotonic()
    runner = ModelRunner(config, random_weights=hf_cfg)
    report.add(name, "start-up (random weights, KV cache)", f"{time.monotonic() - started:.1f} s")
    eager = {}
    for batch in plan.batches:
        if report.out_of_time(f"{name} eager decode batch {batch}"):
            break
        eager[batch] = decode_tokens_per_s(runner, batch, plan, seed=batch)
        report.add(name, f"decode batch {batch}, eager", f"{eager[batch]:.0f} tok/s", tokens_per_s=eager[batch])
    if not report.out_of_time(f"{name} prefill"):
        tps = prefill_tokens_per_s(runner, plan)
        report.add(name, f"prefill {plan.prefill_tokens} tokens", f"{tps:.0f} tok/s", tokens_per_s=tps)
    syncs = forward_host_syncs(runner, plan)
    report.add(name, "host syncs inside the forward", syncs.split(" (")[0] if syncs.startswith("not") else syncs,
               syncs.partition(" (")[2].rstrip(")"))
    if syncs.startswith("SYNC"):
        report.failures.append(f"{name}: host sync in the forward")
    if not report.out_of_time(f"{name} CUDA graphs"):
        started = time.monotonic()
        try:
            runner.graphs = runner.capture_decode_graphs(None if device.type == "cuda" else FakeGraphCapture())
        except Exception as e:  # a capture failure is a finding to report, not a reason to stop
            traceback.print_exc()
            report.add(name, "CUDA graph capture", "FAILED", f"{type(e).__name__}: {str(e)[:120]}")
            report.failures.append(f"{name}: graph capture")
        else:
            kind = "CUDA graphs" if device.type == "cuda" else "fake graphs"
            report.add(name, f"{kind} captured, sizes 1..{max(plan.batches)}", f"{time.monotonic() - started:.1f} s",
                       f"{len(runner.graphs.sizes)} batch sizes")
            for batch in plan.batches:
                if report.out_of_time(f"{name} graph decode batch {batch}"):
                    break
                tps = decode_tokens_per_s(runner, batch, plan, seed=batch)
                gain = f"{tps / eager[batch]:.2f}x eager" if batch in eager else ""
                report.add(name, f"decode batch {batch}, {kind}", f"{tps:.0f} tok/s", gain, tokens_per_s=tps)
    per_block = runner.arena[:, :, 0].numel() * runner.arena.element_size()
    note = f"{runner.num_kv_blocks * per_block / 2**30:.2f} GiB, {per_block / 2**20:.2f} MiB a block"
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        free, _ = torch.cuda.mem_get_info(device)
        report.add(name, "peak memory allocated", f"{peak / 2**30:.1f} GiB", peak_bytes=peak)
        note += f"; {int(free // per_block)} more would fit in the free memory"
    report.add(name, "KV blocks allocated", str(runner.num_kv_blocks), note, blocks=runner.num_kv_blocks)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (with --device cpu: Triton's interpreter)")
    parser.add_argument("--budget-s", type=float, default=540, help="start no measurement after this long")
    parser.add_argument("--models", help="comma-separated subset of the plan's models")
    parser.add_argument("--json", help="also write every row to this file")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1: the engine sections run one engine split over N GPUs of this machine")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        if not args.dry_run:
            parser.error("--device cpu runs only as --dry-run (the Triton kernels through the interpreter)")
        # Before any Triton kernel is defined: on the CPU the kernels run through the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --dry-run, or on the GPU machine")
        return 2
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    device = torch.device(args.device)
    import triton

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"{where}; torch {torch.__version__}, triton {triton.__version__}, Python {sys.version.split()[0]}; "
          f"{plan.dtype}", flush=True)
    report = Report(args.budget_s)
    if args.dry_run:
        report.add("dry run", "tiny shapes: the figures show the code ran", "-", "not how fast anything is")
    started = time.monotonic()
    check_kernels(report, plan, device)
    if not report.out_of_time("decode bandwidth"):
        check_bandwidth(report, plan, device)
    wanted = [m.strip() for m in args.models.split(",")] if args.models else list(plan.models)
    for name in wanted:
        if name not in plan.models:
            parser.error(f"unknown model {name!r}; this plan has {', '.join(plan.models)}")
        if report.out_of_time(f"{name} engine"):
            continue
        if args.tensor_parallel_size > 1:
            from services.bench.gpu_check_tp import check_tensor_parallel

            check_tensor_parallel(report, plan, device, name, plan.models[name], args.tensor_parallel_size)
        else:
            check_engine(report, plan, device, name, plan.models[name])
    report.add("total", "wall time", f"{time.monotonic() - started:.0f} s")
    report.print_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "plan": plan.dtype, "failures": report.failures,
                       "rows": [asdict(r) for r in report.rows]}, f, indent=1, default=str)
    print("FAILURES: " + ", ".join(report.failures) if report.failures else "all checks passed")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
