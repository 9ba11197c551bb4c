"""`pagedserve bench spec-decode`: speculative decoding against none, side by side in one run.

Two engines of the same model in this process, one with `--speculative-config` and one without, run the
same copy-heavy chats (services/bench/offline/copy_workload.py) at each batch size, alternating pass by
pass so that what else runs on the machine falls on both alike. 24 chats by default, 8 of each kind: with
the 6 of earlier versions the figure depended on which six were drawn (prompt lookup's own ceiling on the
bundled model's greedy outputs: 2.07 tokens per step for the first 6 chats, 2.31 for the first 24).
Prefix caching is off, so every pass does the same work. Reports output tokens/s (median and spread of
the passes), the ratio, the acceptance rate and mean acceptance length (vLLM's conventions), and the
knee the scheduler measured. Greedy output must be identical: the run checks it (and, with --identity N
in bfloat16, reports the share of identical outputs and, where two part, the target's own top-2 log-
probability gap at that token: a near-tie).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from services.bench.offline.copy_workload import copy_heavy_chats

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _llm(args, spec):
    from services import LLM

    return LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False,
               num_kv_blocks=args.num_kv_blocks, speculative_config=spec)


def _pass(llm, prompts, params, batch: int) -> dict:
    core = llm.core
    core.scheduler.config.max_num_seqs = batch  # the engine's own cap is the largest batch size
    before = core.stats().spec_decode
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = core.stats().spec_decode
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(len(t) for t in tokens)
    row = {"tokens_per_s": n / seconds, "output_tokens": n, "seconds": seconds, "outputs": tokens}
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        row.update(drafts=drafts, draft_tokens=drafted, accepted_tokens=accepted,
                   acceptance_rate=accepted / drafted if drafted else None,
                   mean_acceptance_length=1 + accepted / drafts if drafts else None, knee_tokens=after.knee_tokens)
    return row


def _summary(rows: list[dict]) -> dict:
    tps = [r["tokens_per_s"] for r in rows]
    out = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
           "passes": len(rows)}
    if "drafts" in rows[0]:
        drafts = sum(r["drafts"] for r in rows)
        drafted = sum(r["draft_tokens"] for r in rows)
        accepted = sum(r["accepted_tokens"] for r in rows)
        out.update(acceptance_rate=accepted / drafted if drafted else None,
                   mean_acceptance_length=1 + accepted / drafts if drafts else None,
                   draft_tokens=drafted, knee_tokens=rows[-1]["knee_tokens"])
    return out


def step_cost_curve(llm, context: int = 256, sizes=(1, 2, 3, 5, 9, 17, 33, 65), reps: int = 5) -> dict:
    """Wall time of one step of T new tokens continuing a `context`-token sequence (median of `reps`), and
    the knee of the least-squares line through them: the measurement the turn-down rule rests on."""
    from services.contracts.step_protocol import SamplingSpec, ScheduledSequence, SchedulerOutput

    core = llm.core
    bs = core.info.block_size
    need = -(-(context + max(sizes)) // bs)
    blocks = [core.pool.allocate() for _ in range(need)]
    table = [b.block_id for b in blocks]
    ids = [(7919 * i) % 30000 + 100 for i in range(context + max(sizes))]
    try:
        core.executor.execute(SchedulerOutput(-2, [ScheduledSequence("cost", ids[:context], 0, table, False,
                                                                    SamplingSpec())]))
        times = {}
        for t in sizes:
            samples = []
            for _ in range(reps):
                out = SchedulerOutput(-2, [ScheduledSequence("cost", ids[context:context + t], context, table, True,
                                                             SamplingSpec())])
                start = time.perf_counter()
                core.executor.execute(out)
                samples.append(time.perf_counter() - start)
            times[t] = statistics.median(samples)
    finally:
        for b in blocks:
            core.pool.free(b)
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {"context": context, "ms_per_step": {t: round(v * 1e3, 2) for t, v in times.items()},
            "fit_ms": {"a": round(a * 1e3, 3), "b": round(b * 1e3, 4)},
            "knee_tokens": round(a / b, 1) if b > 0 else None}


def lookup_ceiling(prompts: list[list[int]], outputs: list[list[int]], spec_cfg, fit_ms: dict) -> dict:
    """What prompt lookup can give on these greedy outputs at best: each step drafts what the proposer
    offers from the prompt and the output so far, verification keeps the draft's agreeing prefix plus one
    token, and a step of T tokens costs a + b*T (the measured fit). No turn-down, no scheduling cost: an
    upper bound on the n-gram method's speedup for this model and workload, whatever the engine does."""
    from services.scheduler.spec_decode.ngram import propose_ngram

    a, b = fit_ms["a"], fit_ms["b"]
    steps = tokens = 0
    cost = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        i = 0
        while i < len(out):
            draft = propose_ngram(list(prompt) + list(out[:i]), spec_cfg.prompt_lookup_min,
                                  spec_cfg.prompt_lookup_max, spec_cfg.num_speculative_tokens)
            agree = next((j for j, (d, t) in enumerate(zip(draft, out[i:], strict=False)) if d != t),
                         min(len(draft), len(out) - i))
            made = min(agree + 1, len(out) - i)
            i += made
            steps += 1
            tokens += made
            cost += a + b * (1 + len(draft))
    plain = tokens * (a + b)
    return {"tokens_per_step": tokens / steps if steps else None, "speedup": plain / cost if cost else None}


def _identity(args, plain, spec, chats) -> dict:
    """Share of identical greedy outputs; at each first difference, the target's top-2 log-prob gap."""
    from services import SamplingParams

    prompts = [plain.tokenizer.apply_chat_template(c) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    a = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    gaps = []
    for prompt, x, y in zip(prompts, a, b, strict=True):
        if x == y:
            continue
        i = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        probe = plain.generate([prompt + x[:i]], SamplingParams(temperature=0, max_tokens=1, logprobs=2),
                               use_tqdm=False)[0].outputs[0].logprobs[0]
        gaps.append(round(probe.top_logprobs[0] - probe.top_logprobs[1], 4))
    return {"outputs": len(prompts), "identical": len(prompts) - len(gaps), "top2_gap_at_divergence": gaps}


def run(args) -> int:
    from services import SamplingParams
    from services.contracts.speculative_config import SpeculativeConfig

    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    spec_cfg = SpeculativeConfig.parse(args.speculative_config or DEFAULT_SPEC)
    plain, spec = _llm(args, None), _llm(args, spec_cfg)
    chats = copy_heavy_chats(max(args.num_prompts, 2 * max(args.batch_sizes)), seed=args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = [plain.tokenizer.apply_chat_template(c) for c in copy_heavy_chats(2, seed=args.seed + 7)]
    for llm in (plain, spec):  # first calls pick and build the CPU kernels: outside the clock
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    report = {"cpu": _cpu_name(), "cores": os.cpu_count(), "dtype": args.dtype, "model": args.model or "bundled",
              "speculative_config": spec_cfg.to_json(), "max_tokens": args.max_tokens, "batches": []}
    print(f"{report['cpu']}, {report['cores']} cores; {args.dtype}; {spec_cfg.to_json()}", flush=True)
    report["step_cost"] = step_cost_curve(plain)
    print(f"step cost (one sequence, {report['step_cost']['context']} tokens of context): "
          f"{report['step_cost']['ms_per_step']} ms; fit {report['step_cost']['fit_ms']} -> knee "
          f"{report['step_cost']['knee_tokens']} tokens", flush=True)
    for batch in args.batch_sizes:
        n = max(args.num_prompts, 2 * batch)
        prompts = [plain.tokenizer.apply_chat_template(c) for c in chats[:n]]
        rows = {"plain": [], "spec": []}
        for p in range(args.passes):
            order = [("plain", plain), ("spec", spec)] if p % 2 == 0 else [("spec", spec), ("plain", plain)]
            for name, llm in order:
                rows[name].append(_pass(llm, prompts, params, batch))
        same = all(r["outputs"] == rows["plain"][0]["outputs"] for r in rows["plain"] + rows["spec"])
        entry = {"batch": batch, "prompts": n, "identical_outputs": same,
                 "plain": _summary(rows["plain"]), "spec": _summary(rows["spec"]),
                 "passes": {k: [{x: v for x, v in r.items() if x != "outputs"} for r in rs] for k, rs in rows.items()}}
        entry["speedup_of_medians"] = entry["spec"]["tokens_per_s_median"] / entry["plain"]["tokens_per_s_median"]
        if batch == 1 and spec_cfg.method == "ngram":
            entry["lookup_ceiling"] = lookup_ceiling(prompts, rows["plain"][0]["outputs"], spec_cfg,
                                                     report["step_cost"]["fit_ms"])
        report["batches"].append(entry)
        s, q = entry["spec"], entry["plain"]
        rate = f"{s['acceptance_rate']:.2f}" if s.get("acceptance_rate") is not None else "-"
        length = f"{s['mean_acceptance_length']:.2f}" if s.get("mean_acceptance_length") is not None else "-"
        print(f"batch {batch:>3}: plain {q['tokens_per_s_median']:7.1f} tok/s [{q['tokens_per_s_min']:.1f}-"
              f"{q['tokens_per_s_max']:.1f}]  spec {s['tokens_per_s_median']:7.1f} tok/s [{s['tokens_per_s_min']:.1f}-"
              f"{s['tokens_per_s_max']:.1f}]  x{entry['speedup_of_medians']:.2f}  acceptance {rate}, mean "
              f"length {length}, draft tokens {s.get('draft_tokens')}, knee {s.get('knee_tokens', 0):.1f}, "
              f"identical {same}", flush=True)
        if "lookup_ceiling" in entry:
            c = entry["lookup_ceiling"]
            print(f"           prompt lookup's ceiling on these outputs: {c['tokens_per_step']:.2f} tokens per step, "
                  f"x{c['speedup']:.2f} at the measured step costs (no turn-down, no scheduling cost)", flush=True)
    if args.identity:
        report["identity"] = _identity(args, plain, spec, copy_heavy_chats(args.identity, seed=args.seed + 1))
        print(f"identity: {report['identity']}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0 if all(b["identical_outputs"] for b in report["batches"]) else 1
