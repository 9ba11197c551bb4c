"""Baseline: vLLM's CPU build, run as a subprocess inside its own virtualenv (`make vllm-env`).

This file runs under the vLLM virtualenv's Python and imports nothing from pagedserve. It reads the
engine settings and every workload (token ids and output lengths) from a JSON file, starts one vLLM
`LLM`, warms it up as pagedserve's run is warmed up, prints `PAGEDSERVE_READY`, then runs the workload
named on each line of its standard input (its prefix cache emptied first, so repeats start alike) and
prints one `PAGEDSERVE_RESULT {json}` line for each; an empty line or end of input ends it. Kept alive
between runs so `bench throughput` can alternate the two systems run by run without restarting vLLM.

With "profile" in the spec, each result carries what vLLM's own metrics say about the run (the
difference of `LLM.get_metrics()` across it): scheduler steps and tokens per step, prefix-cache hit
tokens, preemptions, and its per-request prefill/decode time histograms' sums.
"""

from __future__ import annotations

import json
import sys
import time


def _cpu_seconds() -> float:
    """CPU seconds of this process and its children (vLLM's engine core runs in a child process)."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def _metrics(llm) -> dict:
    """Counters and histogram sums/counts from vLLM's metrics, by name (empty when it has none)."""
    try:
        found = llm.get_metrics()
    except Exception:  # an older vLLM, or stats logging off
        return {}
    out: dict[str, float] = {}
    for m in found:
        name = m.name
        if hasattr(m, "value"):
            out[name] = out.get(name, 0.0) + float(m.value)
        if hasattr(m, "count") and hasattr(m, "sum"):
            out[name + ":count"] = out.get(name + ":count", 0.0) + float(m.count)
            out[name + ":sum"] = out.get(name + ":sum", 0.0) + float(m.sum)
    return out


def _profile(before: dict, after: dict) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = d.get("vllm:iteration_tokens_total:count", 0.0)
    queries = d.get("vllm:prefix_cache_queries", 0.0)
    return {
        "steps": int(steps),
        "tokens_per_step": d.get("vllm:iteration_tokens_total:sum", 0.0) / steps if steps else None,
        "prompt_tokens": int(d.get("vllm:prompt_tokens", 0.0)),
        "prefix_cache_queries": int(queries),
        "prefix_hit_tokens": int(d.get("vllm:prefix_cache_hits", 0.0)),
        "preemptions": int(d.get("vllm:num_preemptions", 0.0)),
        "request_prefill_seconds_sum": d.get("vllm:request_prefill_time_seconds:sum"),
        "request_decode_seconds_sum": d.get("vllm:request_decode_time_seconds:sum"),
        "inter_token_latency_seconds_mean": (d.get("vllm:inter_token_latency_seconds:sum", 0.0)
                                             / d["vllm:inter_token_latency_seconds:count"]
                                             if d.get("vllm:inter_token_latency_seconds:count") else None),
        "metrics": sorted(k for k in after if k.startswith("vllm:")),
    }


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    profile = bool(spec.get("profile"))
    # A GGUF file served as it is: vLLM's --quantization gguf, the tokenizer from its extracted directory.
    extra = {"quantization": spec["quantization"], "tokenizer": spec["tokenizer"]} if spec.get("quantization") else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enable_prefix_caching=True, **extra,
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec.get("max_model_len", 2048), seed=0, disable_log_stats=not profile)
    # The same warm-up as pagedserve's run: a short unrelated prompt, outside the clock.
    warm = [(7919 * i) % 40000 + 100 for i in range(64)]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    print("PAGEDSERVE_READY", flush=True)
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        requests = spec["workloads"][name]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
        llm.reset_prefix_cache()
        before = _metrics(llm) if profile else {}
        cpu = _cpu_seconds()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cpu = _cpu_seconds() - cpu
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        result = {"workload": name, "output_tokens": n, "seconds": elapsed, "tokens_per_s": n / elapsed,
                  "cpu_seconds": cpu}
        if profile:
            result["profile"] = _profile(before, _metrics(llm))
        print("PAGEDSERVE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
