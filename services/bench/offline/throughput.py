"""`pagedserve bench throughput`: our engine and each baseline on one seeded workload, in one run.

Prints a table (output tokens/s, our ratio to each baseline, peak KV efficiency, scheduler CPU time per
step) and optionally writes it as JSON. Timings on a shared machine are noisy: compare the ratios.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from services.bench.offline.kv_efficiency import StepObserver
from services.bench.offline.workloads import offline_workload
from services.commands.bench_flags import lora_counts, one_of, parsed

BASELINES = ("transformers", "vllm", "none")

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def run_ours(llm, requests) -> dict:
    from services import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    # Warm-up outside the clock: first calls pick and build the CPU matmul kernels.
    # A prompt unrelated to the workload, so the warm-up leaves nothing in the prefix cache to reuse.
    warm = [(7919 * i) % 40000 + 100 for i in range(64)]
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    observer = StepObserver()
    observer.wrap_executor(llm.core.executor)
    core = llm.core
    last = [time.perf_counter()]

    def hook(c):
        now = time.perf_counter()
        observer.observe(c, now - last[0])
        last[0] = time.perf_counter()

    llm.step_hook = hook
    start = time.perf_counter()
    last[0] = start
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    llm.step_hook = None
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    spec = core.stats().spec_decode
    speculation = None if spec is None else {
        "acceptance_rate": spec.acceptance_rate, "mean_acceptance_length": spec.mean_acceptance_length,
        "drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens,
        "knee_tokens": spec.knee_tokens}
    return {"system": "pagedserve" if spec is None else "pagedserve (speculative decoding)", "output_tokens": n,
            "seconds": elapsed, "tokens_per_s": n / elapsed, "spec_decode": speculation,
            "kv_efficiency_at_peak": observer.efficiency_at_peak, "peak_kv_blocks": observer.peak_blocks,
            "scheduler_ms_per_step": observer.sched_ms_per_step, "steps": observer.steps,
            "max_running": observer.max_running, "preemptions": core.scheduler.num_preemptions,
            "prefix_hit_tokens": core.kv.prefix_hits}


def weight_format(args) -> str:
    """What the engines' weights are, named in every report (`--quantization gguf`: the GGUF file's own types)."""
    return "gguf (as stored)" if getattr(args, "quantization", None) == "gguf" else f"{args.dtype} (dequantized)"


def _vllm_weights(model_dir, args) -> dict:
    if getattr(args, "quantization", None) != "gguf":
        return {}
    from services.model_files.model_source import gguf_of

    return {"model": str(gguf_of(args.model)), "quantization": "gguf", "tokenizer": str(model_dir)}


def run_vllm(model_dir, requests, args) -> dict:
    if not VLLM_PYTHON.exists():
        return {"system": "vllm", "error": "vLLM virtualenv missing: run `make vllm-env` first"}
    spec = {"model": str(model_dir), "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
            **_vllm_weights(model_dir, args),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": 2048,
            "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests]}
    cores = os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_TARGET_DEVICE="cpu")
    for name in ("OMP_PROC_BIND", "OMP_PLACES"):  # vLLM binds its own threads; leave it its defaults
        env.pop(name, None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_baseline.py")), f.name],
                              env=env, stdout=subprocess.PIPE, stderr=None, text=True, timeout=3600)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("PAGEDSERVE_RESULT "):
            return {"system": "vllm (CPU build, all cores bound, prefix caching)", **json.loads(line.split(" ", 1)[1])}
    return {"system": "vllm", "error": f"vLLM exited {proc.returncode} without a result"}


def check_flags(args) -> None:
    """What `bench throughput` refuses while its command line is parsed (services.commands.flag_rules)."""
    one_of(args, "against", BASELINES)
    if args.lora_adapters:
        parsed(args, "lora_adapters", lora_counts)


def run(args) -> int:
    from services import LLM
    from services.bench.offline.null_executor import scheduler_ms_per_step

    tp = getattr(args, "tensor_parallel_size", 1)
    if getattr(args, "lora_adapters", None):
        from services.bench.offline import lora_mix

        report = lora_mix.run(args, lora_counts(args.lora_adapters))  # checked at parse time (check_flags)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=2))
        return 0
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=tp,
              speculative_config=getattr(args, "speculative_config", None),
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    requests = offline_workload(args.workload, llm.core.info.vocab_size, seed=args.seed, scale=args.scale)
    print(f"workload {args.workload}: {len(requests)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens", flush=True)
    results = [run_ours(llm, requests)]
    sched_256 = scheduler_ms_per_step(llm.tokenizer, num_running=256)
    model_dir = llm.runner.model_dir
    llm.close()
    del llm
    for name in [a.strip() for a in args.against.split(",") if a.strip() and a.strip() != "none"]:
        if name == "transformers" and args.quantization == "gguf":
            # Side by side only on the same weights: transformers dequantizes a GGUF file when it loads it.
            results.append({"system": "transformers", "error": "runs GGUF weights dequantized, not as stored: "
                                                               "not the same weight format"})
        elif name == "transformers":
            from services.bench.offline.hf_baseline import run_transformers

            results.append(run_transformers(model_dir, requests, args.dtype))
        elif name == "vllm":
            results.append(run_vllm(model_dir, requests, args))
    ours = results[0]
    for r in results[1:]:
        if "tokens_per_s" in r:
            r["pagedserve_ratio"] = ours["tokens_per_s"] / r["tokens_per_s"]
    report = {"workload": args.workload, "dtype": args.dtype, "weight_format": weight_format(args),
              "kv_cache_dtype": args.kv_cache_dtype, "tensor_parallel_size": tp, "requests": len(requests),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "results": results,
              "scheduler_ms_per_step_at_256_running": sched_256}
    _print_table(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


def _print_table(report: dict) -> None:
    print()
    print(f"weights: {report['weight_format']}, on every side; KV cache: {report['kv_cache_dtype']}")
    print(f"{'system':<52} {'tok/s':>8} {'pagedserve x':>13}")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['system']:<52} {'-':>8} {'-':>13}  ({r['error']})")
            continue
        ratio = r.get("pagedserve_ratio")
        print(f"{r['system']:<52} {r['tokens_per_s']:>8.1f} {(f'{ratio:.2f}x' if ratio else ''):>13}")
    ours = report["results"][0]
    print(f"\npeak KV efficiency (live token slots / allocated slots): {100 * ours['kv_efficiency_at_peak']:.1f}%")
    print(f"scheduler CPU per step: {ours['scheduler_ms_per_step']:.3f} ms in this run "
          f"(max {ours['max_running']} running); {report['scheduler_ms_per_step_at_256_running']:.3f} ms "
          f"at 256 running (null engine)")
    print(f"preemptions: {ours['preemptions']}, prefix-cache hit tokens: {ours['prefix_hit_tokens']}")
    spec = ours.get("spec_decode")
    if spec is not None:
        print(f"speculative decoding: acceptance rate {spec['acceptance_rate']}, mean acceptance length "
              f"{spec['mean_acceptance_length']} ({spec['draft_tokens']} draft tokens; knee {spec['knee_tokens']:.1f} "
              f"tokens)")
