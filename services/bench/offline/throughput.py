"""`pagedserve bench throughput`: our engine and each baseline on seeded workloads, in one run.

`--workload all` runs W1, W2 and W3; `--repeats N` runs each N times, alternating the systems run by run
(pagedserve on W1, vLLM on W1, pagedserve on W2, ...), so that a change in the machine's load lands on
both. vLLM runs in one subprocess of its own virtualenv kept alive across the runs; each run of either
system starts from an empty prefix cache after the same warm-up. Prints, per workload, output tokens/s of
each system (median and range over the repeats), our ratio to each baseline (median, range and every
repeat's), CPU seconds per output token (the steadier figure on a shared machine: time the host gave to
other jobs is not in it), peak KV efficiency and the scheduler's CPU time per step; `--json` writes it
all with the machine (CPU model and the instruction sets that pick pagedserve's kernels) and the kernel
paths pagedserve took. `--profile` adds a profiled run per workload (services/bench/offline/step_profile.py)
and vLLM's own metrics of its runs.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.bench.offline.kv_efficiency import StepObserver
from services.bench.offline.workloads import offline_workload
from services.commands.bench_flags import lora_counts, one_of, parsed

BASELINES = ("transformers", "vllm", "none")

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
WORKLOADS = ("w1", "w2", "w3")
VLLM_NAME = "vllm (CPU build, all cores bound, prefix caching)"


def _warm_up(llm) -> None:
    from services import SamplingParams

    # First calls pick and build the CPU matmul kernels. A prompt unrelated to the workload, and the prefix
    # cache emptied before each run, so nothing of it is reused.
    warm = [(7919 * i) % 40000 + 100 for i in range(64)]
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


def run_ours(llm, requests, profiler=None) -> dict:
    from services import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    core = llm.core
    core.pool.reset_cache()  # every run (and every repeat) starts from an empty prefix cache
    hits0, preempt0 = core.kv.prefix_hits, core.scheduler.num_preemptions
    observer = StepObserver()
    inner_execute = core.executor.execute
    observer.wrap_executor(core.executor)
    if profiler is not None:
        profiler.attach(llm)
    last = [time.perf_counter()]

    def hook(c):
        now = time.perf_counter()
        observer.observe(c, now - last[0])
        if profiler is not None:
            profiler.observe(c, now - last[0])
        last[0] = time.perf_counter()

    llm.step_hook = hook
    cpu = time.process_time()
    start = time.perf_counter()
    last[0] = start
    try:
        outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    finally:
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        llm.step_hook = None
        core.executor.execute = inner_execute
        if profiler is not None:
            profiler.detach()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    spec = core.stats().spec_decode
    speculation = None if spec is None else {
        "acceptance_rate": spec.acceptance_rate, "mean_acceptance_length": spec.mean_acceptance_length,
        "drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens,
        "knee_tokens": spec.knee_tokens}
    return {"system": "pagedserve" if spec is None else "pagedserve (speculative decoding)", "output_tokens": n,
            "seconds": elapsed, "tokens_per_s": n / elapsed, "spec_decode": speculation,
            "cpu_seconds": cpu, "kv_efficiency_at_peak": observer.efficiency_at_peak,
            "peak_kv_blocks": observer.peak_blocks, "scheduler_ms_per_step": observer.sched_ms_per_step,
            "steps": observer.steps, "max_running": observer.max_running,
            "preemptions": core.scheduler.num_preemptions - preempt0, "prefix_hit_tokens": core.kv.prefix_hits - hits0}


def weight_format(args) -> str:
    """What the engines' weights are, named in every report (`--quantization gguf`: the GGUF file's own types)."""
    return "gguf (as stored)" if getattr(args, "quantization", None) == "gguf" else f"{args.dtype} (dequantized)"


def _vllm_weights(model_dir, args) -> dict:
    if getattr(args, "quantization", None) != "gguf":
        return {}
    from services.model_files.model_source import gguf_of

    return {"model": str(gguf_of(args.model)), "quantization": "gguf", "tokenizer": str(model_dir)}


class VllmBaseline:
    """vLLM's `LLM` in a subprocess of its own virtualenv (vllm_baseline.py), one workload per request."""

    def __init__(self, model_dir, workloads: dict, args, profile: bool):
        spec = {"model": str(model_dir), "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": 2048, "profile": profile,
                **_vllm_weights(model_dir, args),
                "workloads": {name: [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                                     for r in reqs] for name, reqs in workloads.items()}}
        cores = os.cpu_count() or 1
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE="4",
                   VLLM_TARGET_DEVICE="cpu")
        for name in ("OMP_PROC_BIND", "OMP_PLACES"):  # vLLM binds its own threads; leave it its defaults
            env.pop(name, None)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        self._spec_path = f.name
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_baseline.py")), f.name],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True)
        self._read("PAGEDSERVE_READY")

    def _read(self, marker: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker):].strip()
            sys.stderr.write(line)  # vLLM logs to stdout: keep our table clean
        raise RuntimeError(f"vLLM exited ({self.proc.wait()}) before {marker}")

    def run(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return {"system": VLLM_NAME, **json.loads(self._read("PAGEDSERVE_RESULT"))}

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.unlink(self._spec_path)


def _cpu_flags() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in (platform.processor(), platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    return model, flags


def machine() -> dict:
    """The CPU, the instruction sets that choose pagedserve's kernels, and the paths they chose here."""
    import kernels.cpu as cpu_kernels
    from services.engine.linear import cpu_gemm_choice

    model, flags = _cpu_flags()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    mod = cpu_kernels.load()
    paths = {"linears": "none (no C++ kernels)" if mod is None else cpu_gemm_choice(), "amx_in_use": False}
    if mod is not None:
        paths["amx_in_use"] = cpu_kernels.amx_in_use()
        paths["prefill_kernel"] = ("amx" if paths["amx_in_use"] and mod.amx_prefill_supported(64) else
                                   "avx512-bf16" if mod.prefill_bf16_supported(64) else "sdpa")
        paths["decode_kernel"] = ("amx" if paths["amx_in_use"] else
                                  "avx512-bf16" if mod.decode_bf16_usable(3, 64, 3) else "portable")
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "arch": platform.machine(),
            "PAGEDSERVE_CPU_AMX": os.environ.get("PAGEDSERVE_CPU_AMX", "(unset: 1)"), "pagedserve_paths": paths}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "each": values}


def _summary(runs: list[list[dict]]) -> dict:
    """Per system over the repeats: tokens/s and CPU s per output token; our ratio to each baseline."""
    out = {}
    systems = [r["system"] for r in runs[0]]
    for i, name in enumerate(systems):
        ok = [run[i] for run in runs if "tokens_per_s" in run[i]]
        if not ok:
            continue
        entry = {"tokens_per_s": _spread([r["tokens_per_s"] for r in ok])}
        if all(r.get("cpu_seconds") == r.get("cpu_seconds") and "cpu_seconds" in r for r in ok):  # not NaN
            entry["cpu_ms_per_output_token"] = _spread([1000 * r["cpu_seconds"] / r["output_tokens"] for r in ok])
        if i:
            ratios = [run[0]["tokens_per_s"] / run[i]["tokens_per_s"] for run in runs if "tokens_per_s" in run[i]]
            entry["pagedserve_ratio"] = _spread(ratios)
        out[name] = entry
    return out


def _git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
        return _run_lora(args)
    names = WORKLOADS if args.workload == "all" else (args.workload,)
    repeats = getattr(args, "repeats", 1)  # >= 1 and the baselines' names: checked at parse time (check_flags)
    profile = getattr(args, "profile", False)
    against = [a.strip() for a in args.against.split(",") if a.strip() and a.strip() != "none"]
    quantization = getattr(args, "quantization", None)
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=tp,
              speculative_config=getattr(args, "speculative_config", None),
              quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    workloads = {n: offline_workload(n, llm.core.info.vocab_size, seed=args.seed, scale=args.scale) for n in names}
    for n, reqs in workloads.items():
        print(f"workload {n}: {len(reqs)} requests, {sum(len(r.prompt_token_ids) for r in reqs)} prompt tokens, "
              f"{sum(r.output_len for r in reqs)} output tokens", flush=True)
    model_dir = llm.runner.model_dir
    _warm_up(llm)
    vllm = None
    if "vllm" in against:
        if not VLLM_PYTHON.exists():
            vllm = {"system": "vllm", "error": "vLLM virtualenv missing: run `make vllm-env` first"}
        else:
            vllm = VllmBaseline(model_dir, workloads, args, profile)
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    try:
        for rep in range(repeats):
            for n in names:
                results = [run_ours(llm, workloads[n])]
                for name in against:
                    if name == "transformers" and quantization == "gguf":
                        # Side by side only on the same weights: transformers dequantizes a GGUF file it loads.
                        results.append({"system": "transformers", "error": "runs GGUF weights dequantized, not as "
                                                                           "stored: not the same weight format"})
                    elif name == "transformers":
                        from services.bench.offline.hf_baseline import run_transformers

                        results.append(run_transformers(model_dir, workloads[n], args.dtype))
                    elif isinstance(vllm, dict):
                        results.append(dict(vllm))
                    else:
                        results.append(vllm.run(n))
                for r in results[1:]:
                    if "tokens_per_s" in r:
                        r["pagedserve_ratio"] = results[0]["tokens_per_s"] / r["tokens_per_s"]
                runs[n].append(results)
                done = [f"{r['system'].split(' ')[0]} {r['tokens_per_s']:.1f} tok/s" for r in results
                        if "tokens_per_s" in r]
                print(f"repeat {rep + 1}/{repeats} {n}: " + ", ".join(done), flush=True)
    finally:
        if vllm is not None and not isinstance(vllm, dict):
            vllm.close()
    profiles = {}
    if profile:
        from services.bench.offline.step_profile import StepProfiler

        for n in names:
            profiler = StepProfiler()
            result = run_ours(llm, workloads[n], profiler)
            profiles[n] = {"pagedserve": {"tokens_per_s": result["tokens_per_s"], **profiler.summary()}}
            vllm_profiles = [r.get("profile") for run in runs[n] for r in run[1:] if r.get("profile")]
            if vllm_profiles:
                profiles[n]["vllm"] = vllm_profiles[0]
    sched_256 = scheduler_ms_per_step(llm.tokenizer, num_running=256)
    llm.close()
    command = ("pagedserve bench throughput " + " ".join(sys.argv[3:])
               if sys.argv[1:3] == ["bench", "throughput"] else None)
    report = {"command": command, "commit": _git_commit(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "dtype": args.dtype, "weight_format": weight_format(args), "kv_cache_dtype": kv_cache_dtype,
              "tensor_parallel_size": tp, "repeats": repeats, "machine": machine(),
              "workloads": {n: {"requests": len(workloads[n]),
                                "prompt_tokens": sum(len(r.prompt_token_ids) for r in workloads[n]),
                                "output_tokens": sum(r.output_len for r in workloads[n]),
                                "summary": _summary(runs[n]), "runs": runs[n],
                                **({"profile": profiles[n]} if n in profiles else {})} for n in names},
              "scheduler_ms_per_step_at_256_running": sched_256,
              # The first workload's first run, as single-run reports had it (bench before-after reads it).
              "workload": names[0], "results": runs[names[0]][0]}
    _print_report(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


def _run_lora(args) -> int:
    from services.bench.offline import lora_mix

    report = lora_mix.run(args, lora_counts(args.lora_adapters))  # checked at parse time (check_flags)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


def _range(s: dict, fmt: str = "{:.1f}") -> str:
    if len(s["each"]) == 1:
        return fmt.format(s["median"])
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def _print_report(report: dict) -> None:
    m = report["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, {' '.join(m['isa'])}; PAGEDSERVE_CPU_AMX={m['PAGEDSERVE_CPU_AMX']}; "
          f"pagedserve kernels: {m['pagedserve_paths']}")
    print(f"weights: {report['weight_format']}, on every side; KV cache: {report['kv_cache_dtype']}")
    print(f"medians of {report['repeats']} repeat(s) [min-max]")
    print(f"{'workload':<9}{'system':<52}{'out tok/s':>22}{'CPU ms/out tok':>22}{'pagedserve x':>24}")
    for n, w in report["workloads"].items():
        for system, s in w["summary"].items():
            cpu = _range(s["cpu_ms_per_output_token"], "{:.2f}") if "cpu_ms_per_output_token" in s else "-"
            ratio = s.get("pagedserve_ratio")
            print(f"{n:<9}{system[:51]:<52}{_range(s['tokens_per_s']):>22}{cpu:>22}"
                  f"{(_range(ratio, '{:.2f}x') if ratio else ''):>24}")
            if ratio and len(ratio["each"]) > 1:
                print(f"{'':<61}repeats: {', '.join(f'{x:.2f}x' for x in ratio['each'])}")
        for run in w["runs"]:
            for r in run:
                if "error" in r:
                    print(f"{n:<9}{r['system']:<52}  ({r['error']})")
        ours = w["runs"][0][0]
        print(f"{'':<9}peak KV efficiency {100 * ours['kv_efficiency_at_peak']:.1f}%, scheduler "
              f"{ours['scheduler_ms_per_step']:.3f} ms/step over {ours['steps']} steps (max {ours['max_running']} "
              f"running), preemptions {ours['preemptions']}, prefix-hit tokens {ours['prefix_hit_tokens']}")
        spec = ours.get("spec_decode")
        if spec is not None:
            print(f"{'':<9}speculative decoding: acceptance rate {spec['acceptance_rate']}, mean acceptance length "
                  f"{spec['mean_acceptance_length']} ({spec['draft_tokens']} draft tokens; knee "
                  f"{spec['knee_tokens']:.1f} tokens)")
        if "profile" in w:
            from services.bench.offline.step_profile import print_summary

            print(f"{n} profile, pagedserve:", end="")
            print_summary(w["profile"]["pagedserve"])
            if "vllm" in w["profile"]:
                v = w["profile"]["vllm"]
                print(f"{n} vLLM's own metrics: {v['steps']} steps, {v['tokens_per_step'] or 0:.1f} tokens/step, "
                      f"prefix-hit tokens {v['prefix_hit_tokens']}, preemptions {v['preemptions']}")
    print(f"\nscheduler CPU per step at 256 running (null engine): "
          f"{report['scheduler_ms_per_step_at_256_running']:.3f} ms")
