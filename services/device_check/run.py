"""The device check of the GPU engine path: `python -m services.device_check.run` (`make gpu-check`, and on a
machine with no network `make gpu-check-offline`, make/gpu.mk).

One run on one GPU, about 7 minutes on an H200, no network and no download (random weights in the real
shapes of Llama-3.2-1B and Llama-3.1-8B, bfloat16). Each section runs on its own within a printed time
budget (a failure is a FAILED row and the next section runs), and every row is appended at once to a
table file ($OUT/gpu_check.md when OUT is set, else .bench/gpu_check.md), so a killed run still returns
what it measured. Sections:

1. kernels, per dtype (bfloat16 and float16): each Triton kernel against its PyTorch reference (max abs and
   relative error), and each compiled variant's registers and spills;
2. decode attention at batch 64, context 4096, 32 query / 8 KV heads, head dim 128, block 16: achieved
   bandwidth against the measured copy bandwidth (goal >= 80%) and against torch's
   scaled_dot_product_attention on contiguous KV;
3. engine correctness (services/device_check/correctness.py): greedy tokens replayed from CUDA graphs ==
   eager at a captured batch size, prefix hits, chunked prefill and preemption on the Triton backend,
   seeded sampling reproducible;
4. per model, the engine alone (ModelRunner, synthetic steps, no scheduler): start-up (kernel warm-up
   included), decode tokens/s at batch 1, 32 and 256, eager and replayed from CUDA graphs, graph
   capture time, prefill tokens/s at 2,048 tokens, that the forward makes no host sync
   (torch.cuda.set_sync_debug_mode("error")), that no Triton kernel compiled after start-up, peak
   memory and the KV blocks allocated; with `--tensor-parallel-size N`, the same engine split over N
   GPUs instead (services/device_check/tensor_parallel.py).

The run passes only if every planned section ran and passed (services/device_check/report.py): a skipped,
timed-out or missing section fails it, and `--force-skip SECTION` proves that (make test runs it). Time
limits are checked between sections and measurements, never by interrupting a graph capture or a compile.

`--device cpu --dry-run` runs the same code at tiny shapes in float32 and float16 through Triton's
interpreter and a fake graph capture (make test does, twice: once through `make gpu-check-offline` with
an interpreter holding only torch and Triton). It lives in services.bench, not kernels, because it
drives the engine (kernels may not import services: docs/architecture.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from services.device_check.compile_watch import CompileWatch
from services.device_check.report import Report, default_table_path
from services.device_check.workload import DRY_PLAN, GPU_PLAN, Plan, decode_tokens_per_s, prefill_tokens_per_s


def check_kernels(report: Report, plan: Plan, device, dtype_name: str) -> None:
    import torch

    from kernels.bench import check_correctness
    from kernels.triton_variants import compiled_resources

    section = f"kernels {dtype_name}"
    for r in check_correctness(device, getattr(torch, dtype_name), plan.check_shapes, plan.check_max_len):
        report.add(section, r["name"], f"{r['max_abs_err']:.2e}",
                   f"max abs err; rel {r['rel_err']:.1e}" + ("" if r["ok"] else "  FAIL"), **r)
        if not r["ok"]:
            report.fail(f"{section}: {r['name']}")
    if device.type != "cuda":
        return
    for r in compiled_resources():
        spills = r["n_spills"]
        report.add(section, f"{r['kernel']} variant, {r['num_warps']} warps", f"{r['n_regs']} regs",
                   f"{spills} bytes spilled" + ("  SPILLS" if spills else ""), **r)


def check_bandwidth(report: Report, plan: Plan, device) -> None:
    import torch

    from kernels.bench import GOAL_FRACTION, BenchShape, bench_decode, bench_sdpa_decode
    from kernels.bench_timing import copy_bandwidth

    copy_bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (16 << 20))
    report.add("bandwidth", "device copy (read + write)", f"{copy_bw / 1e9:.0f} GB/s", bandwidth=copy_bw)
    shape_kw, batch, ctx = plan.goal
    shape = BenchShape(**shape_kw, **({} if device.type == "cuda" else {"dtype": getattr(torch, plan.dtype)}))
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


def forward_host_syncs(runner, plan: Plan) -> str:
    """Run a mixed eager step (prefills beside decodes) with CUDA's sync debug mode set to error."""
    import random

    import torch

    from services.device_check.step_driver import StepDriver

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
        # Only the sync debug mode's own error is a host sync; anything else fails the section as itself.
        if "synchroniz" not in str(e):
            raise
        return f"SYNC: {str(e).splitlines()[0]}"
    finally:
        del runner.model.forward
        runner.graphs = graphs


def check_engine(report: Report, plan: Plan, device, name: str, hf_cfg: dict) -> None:
    import torch

    from services.engine.config import EngineConfig

    need = max(plan.batches) * -(-(plan.prompt_len + plan.warmup_steps + plan.decode_steps + 1) // 16)
    config = EngineConfig(dtype=plan.dtype, device=device.type, block_size=16, num_kv_blocks=need + 64,
                          max_model_len=plan.max_model_len, attention_backend="triton", enforce_eager=True,
                          max_num_seqs=max(plan.batches))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # Triton's public post-compile hook, before the engine starts (its warm-up compiles are start-up's);
    # a Triton without it fails this section here, loudly.
    watch = CompileWatch().start()
    try:
        _engine_rows(report, plan, device, name, config, hf_cfg, watch)
    finally:
        watch.stop()


def _engine_rows(report: Report, plan: Plan, device, name: str, config, hf_cfg: dict, watch: CompileWatch) -> None:
    import torch

    from services.engine.cuda_graphs import FakeGraphCapture
    from services.engine.model_runner import ModelRunner

    started = time.monotonic()
    runner = ModelRunner(config, random_weights=hf_cfg)
    report.add(name, "start-up (random weights, KV cache, warm-up)", f"{time.monotonic() - started:.1f} s",
               f"{watch.total()} Triton compiles")
    mark = watch.counts.copy()
    late: dict[str, int] = {}

    def count_late_compiles() -> None:
        # Variants compiled since the last mark: on a serving engine, compiles while serving.
        nonlocal mark
        for k, n in watch.since(mark).items():
            late[k] = late.get(k, 0) + n
        mark = watch.counts.copy()

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
        report.fail(f"{name}: host sync in the forward")
    count_late_compiles()
    if not report.out_of_time(f"{name} CUDA graphs"):
        started = time.monotonic()
        try:
            runner.graphs = runner.capture_decode_graphs(None if device.type == "cuda" else FakeGraphCapture())
        except Exception as e:  # a capture failure is a finding to report; the memory rows still follow
            from services.device_check.report import describe_error

            report.add(name, "CUDA graph capture", "FAILED", describe_error(e))
            report.fail(f"{name}: graph capture: {describe_error(e)}")
        else:
            mark = watch.counts.copy()  # capture is part of start-up on a serving engine
            kind = "CUDA graphs" if device.type == "cuda" else "fake graphs"
            report.add(name, f"{kind} captured, sizes 1..{max(plan.batches)}", f"{time.monotonic() - started:.1f} s",
                       f"{len(runner.graphs.sizes)} batch sizes")
            for batch in plan.batches:
                if report.out_of_time(f"{name} graph decode batch {batch}"):
                    break
                tps = decode_tokens_per_s(runner, batch, plan, seed=batch)
                gain = f"{tps / eager[batch]:.2f}x eager" if batch in eager else ""
                report.add(name, f"decode batch {batch}, {kind}", f"{tps:.0f} tok/s", gain, tokens_per_s=tps)
            count_late_compiles()
    if device.type == "cuda":
        report.add(name, "Triton compiles after start-up", str(sum(late.values())),
                   (", ".join(f"{k} {n}" for k, n in late.items()) or "every variant was warmed")
                   + " (counted by triton.knobs.runtime.jit_post_compile_hook)", **late)
        if late:
            report.fail(f"{name}: Triton compiled while serving ({late})")
    else:
        report.add(name, "Triton compiles after start-up", "-", "not counted: the interpreter compiles nothing")
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


def _free_device(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.device_check.run", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (with --device cpu: Triton's interpreter)")
    parser.add_argument("--budget-s", type=float, help="the whole run's time budget (default: the plan's)")
    parser.add_argument("--models", help="comma-separated subset of the plan's models")
    parser.add_argument("--sections", help="comma-separated subset: kernels, bandwidth, correctness, engine")
    parser.add_argument("--table", type=Path, help="the table file, appended row by row (default: "
                        "$OUT/gpu_check.md when OUT is set, else .bench/gpu_check.md)")
    parser.add_argument("--json", type=Path, help="also write every row to this file at the end (default with "
                        "$OUT set: $OUT/gpu_check.json)")
    parser.add_argument("--force-skip", default="", help="comma-separated sections to skip without running them "
                        "(to see a skipped section fail the run), e.g. 'kernels float16' or tiny-llama")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1: the engine sections run one engine split over N GPUs of this machine")
    args = parser.parse_args(argv)
    from kernels.triton_common import interpreting

    if args.device == "cpu":
        if not args.dry_run:
            parser.error("--device cpu runs only as --dry-run (the Triton kernels through the interpreter)")
        # Before any Triton kernel is defined: on the CPU the kernels run through the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    elif interpreting():
        parser.error("TRITON_INTERPRET is set: on CUDA the check measures compiled kernels; unset it")
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    wanted = [m.strip() for m in args.models.split(",")] if args.models else list(plan.models)
    for name in wanted:
        if name not in plan.models:
            parser.error(f"unknown model {name!r}; this plan has {', '.join(plan.models)}")
    sections = {s.strip() for s in (args.sections or "kernels,bandwidth,correctness,engine").split(",")}
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --dry-run, or on the GPU machine")
        return 2
    device = torch.device(args.device)
    import triton

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    report = Report(args.budget_s or plan.run_budget_s, args.table or default_table_path("gpu_check.md"),
                    force_skip=frozenset(x.strip() for x in args.force_skip.split(",") if x.strip()))
    report.note(f"{where}; torch {torch.__version__}, triton {triton.__version__}, Python "
                f"{sys.version.split()[0]}; engine dtype {plan.dtype}")
    budgets = {f"kernels {d}": plan.budget(f"kernels {d}") for d in plan.kernel_dtypes} if "kernels" in sections else {}
    if "bandwidth" in sections:
        budgets["decode bandwidth"] = plan.budget("decode bandwidth")
    if "correctness" in sections:
        budgets["engine correctness"] = plan.budget("engine correctness")
    if "engine" in sections:
        budgets.update({m: plan.budget("tp" if args.tensor_parallel_size > 1 else m) for m in wanted})
    report.note("time budgets: " + ", ".join(f"{k} {v:.0f} s" for k, v in budgets.items())
                + f"; the run {report.deadline - report.started:.0f} s")
    tp = args.tensor_parallel_size
    report.plan([k if k not in wanted or tp == 1 else f"{k} TP={tp}" for k in budgets])
    if args.sections:
        report.note(f"PARTIAL run: only the sections asked for ({args.sections}); a full check runs them all")
    unknown = report.force_skip - set(report.planned)
    if unknown:
        parser.error(f"--force-skip names no planned section: {', '.join(sorted(unknown))}")
    if args.dry_run:
        report.add("dry run", "tiny shapes: the figures show the code ran", "-", "not how fast anything is")
    for dtype_name in plan.kernel_dtypes if "kernels" in sections else ():
        report.section(f"kernels {dtype_name}", budgets[f"kernels {dtype_name}"], check_kernels, report, plan,
                       device, dtype_name)
    if "bandwidth" in sections:
        report.section("decode bandwidth", budgets["decode bandwidth"], check_bandwidth, report, plan, device)
        _free_device(device)
    if "correctness" in sections:
        from services.device_check.correctness import check_engine_correctness

        first = wanted[0]
        report.section("engine correctness", budgets["engine correctness"], check_engine_correctness, report, plan,
                       device, first, plan.models[first])
        _free_device(device)
    for name in wanted if "engine" in sections else ():
        if args.tensor_parallel_size > 1:
            from services.device_check.tensor_parallel import check_tensor_parallel

            report.section(f"{name} TP={args.tensor_parallel_size}", budgets[name], check_tensor_parallel, report,
                           plan, device, name, plan.models[name], args.tensor_parallel_size)
        else:
            report.section(name, budgets[name], check_engine, report, plan, device, name, plan.models[name])
        _free_device(device)
    report.add("total", "wall time", f"{time.monotonic() - report.started:.0f} s")
    report.print_table()
    json_path = args.json or (default_table_path("gpu_check.json") if os.environ.get("OUT") else None)
    if json_path is not None:
        report.write_json(json_path, device=where, plan=plan.dtype)
    return 0 if report.finish() else 1


if __name__ == "__main__":
    sys.exit(main())
