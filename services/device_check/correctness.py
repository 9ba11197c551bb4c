"""The GPU check's engine correctness section: what the device computes, not how fast.

The tested engine (the plan's first model, random weights, the Triton backend in the plan's dtype) is
compared with a **float32 reference of the same weights**: a second engine in float32 on the PyTorch
reference backend whose random weights are drawn exactly as the tested engine's are (in the plan's
dtype, then held in float32: services.engine.model_loader.RANDOM_DRAW_DTYPE), so the two differ only in
how they compute. The reference runs each scenario greedily; the tested engine is then fed the
reference's tokens (teacher forcing), so both see the same context at every step, and every logits row
is compared: the largest |tested - reference| over the vocabulary, as a fraction of the reference row's
RMS, must stay within LOGIT_BOUND of the dtype. No token is excused as a near-tie: a greedy choice that
differs is reported (argmax agreement), the verdict is the logits' distance.

Scenarios: a batch replayed from CUDA graphs at a captured size and the same batch eager; a prompt
prefilled in chunks; a prefix hit (a sequence whose first blocks are another's, computed once); a
sequence preempted and recomputed into fresh blocks. Seeded sampling must give the same tokens twice.
On the CPU dry run the graphs are the fake capture and the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.device_check.report import Report
from services.device_check.step_driver import StepDriver, SyntheticSequence
from services.device_check.workload import Plan

# Largest |logit - reference logit| allowed in a row, as a fraction of the reference row's RMS, by the
# tested engine's dtype. float32: the same math in another order. bfloat16 and float16: 3x the largest
# fraction the same comparison measured on the CPU with the PyTorch reference backend in that dtype against
# the float32 reference, on random Llama-3.2-1B-shaped weights (`python -m services.device_check.logit_error`,
# docs/figures.md: bfloat16 0.146, float16 0.0172, 2026-12-03), for the Triton kernels' other summation
# order. A real fault (a wrong block, position or mask) gives rows unrelated to the reference's: several
# times the RMS.
LOGIT_BOUND = {"float32": 1e-3, "float16": 0.06, "bfloat16": 0.45}


@dataclass
class GreedyRun:
    """One sequence's tokens and, per token, the logits row it was chosen from (float32, host)."""

    tokens: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)

    def __add__(self, other: GreedyRun) -> GreedyRun:
        return GreedyRun(self.tokens + other.tokens, self.logits + other.logits)


class LogitDriver(StepDriver):
    """A StepDriver that keeps every sampled row's logits and takes each token from `forced` (a sequence's
    tokens to feed, in order) while it has one, else the row's argmax."""

    def __init__(self, runner, first_block: int = 0, forced: dict[str, list[int]] | None = None):
        super().__init__(runner, first_block)
        self.runs: dict[str, GreedyRun] = {}
        self.forced = forced or {}

    def execute(self, out) -> dict[str, list[int]]:
        import torch

        runner = self.runner
        with torch.inference_mode():
            graphs = runner.graphs
            step = runner.inputs.build(out, graphs.batch_for if graphs is not None else None)
            ran = runner.run_step(step)
            # A copy: a replayed graph's logits are its static output, refilled by the next replay.
            logits = ran[0][:len(step.rows)].to("cpu", torch.float32, copy=True)
        sampled = {}
        for owner, row in zip(step.owners, logits, strict=True):
            run = self.runs.setdefault(owner, GreedyRun())
            script = self.forced.get(owner, [])
            token = script[len(run.tokens)] if len(run.tokens) < len(script) else int(row.argmax())
            sampled[owner] = [token]
            run.tokens.append(token)
            run.logits.append(row)
        return sampled


@dataclass
class Agreement:
    rows: int = 0  # logits rows compared
    argmax_equal: int = 0  # rows whose argmax is the reference's token
    max_abs_diff: float = 0.0
    max_fraction: float = 0.0  # largest max|diff| / RMS(reference row)
    mismatches: list[str] = field(default_factory=list)

    def describe(self, bound: float) -> str:
        return (f"{self.rows} rows: max |logit diff| {self.max_abs_diff:.3g} = {self.max_fraction:.3g} of the "
                f"reference row's RMS (bound {bound:g}); argmax equal in {self.argmax_equal}/{self.rows}")


def compare(reference: dict[str, GreedyRun], other: dict[str, GreedyRun], bound: float) -> Agreement:
    """Every row of `other` (fed the reference's tokens) against the reference's row at the same step."""
    a = Agreement()
    for seq_id, ref in reference.items():
        run = other.get(seq_id, GreedyRun())
        if len(run.logits) != len(ref.logits):
            a.mismatches.append(f"{seq_id}: {len(run.logits)} rows, not {len(ref.logits)}")
        for i, (r, o) in enumerate(zip(ref.logits, run.logits, strict=False)):
            diff = float((r - o).abs().max())
            rms = float(r.pow(2).mean().sqrt())
            fraction = diff / rms if rms > 0 else float("inf")
            a.rows += 1
            a.argmax_equal += int(o.argmax()) == ref.tokens[i]
            a.max_abs_diff, a.max_fraction = max(a.max_abs_diff, diff), max(a.max_fraction, fraction)
            if not fraction <= bound:
                a.mismatches.append(f"{seq_id} step {i}: max |logit diff| {diff:.3g} = {fraction:.3g} of RMS "
                                    f"> {bound:g}")
    return a


def _greedy(runner, prompts: dict[str, list[int]], steps: int, first_block: int, chunk: int | None = None,
            forced: dict[str, GreedyRun] | None = None) -> dict[str, GreedyRun]:
    d = LogitDriver(runner, first_block, {k: r.tokens for k, r in (forced or {}).items()})
    for seq_id, prompt in prompts.items():
        d.add(seq_id, prompt)
    d.prefill(chunk or sum(map(len, prompts.values())))
    for _ in range(steps - 1):
        d.step()
    return d.runs


def _prefix_hit(runner, prompt: list[int], steps: int, first_block: int, forced: GreedyRun) -> GreedyRun:
    """'a' computes the prompt; 'b', the same prompt, starts with a's full blocks (all but the block
    holding the last token, as a prefix cache hands them out) and computes only the rest."""
    d = LogitDriver(runner, first_block, {"a": forced.tokens, "b": forced.tokens})
    d.add("a", prompt)
    d.step()
    shared = (len(prompt) - 1) // d.block_size
    d.seqs["b"] = SyntheticSequence("b", list(prompt), d.seqs["a"].table[:shared], computed=shared * d.block_size)
    for _ in range(steps):
        d.step({"a": 0})
    return d.runs["b"]


def _preempted(runner, prompt: list[int], steps: int, first_block: int, chunk: int, forced: GreedyRun) -> GreedyRun:
    """Decode part way, drop the sequence's blocks, recompute prompt + output in chunks into fresh blocks
    (as the scheduler does after a preemption), and decode on."""
    d = LogitDriver(runner, first_block, {"p": forced.tokens})
    d.add("p", prompt)
    for _ in range(steps // 2):
        d.step()
    before = d.runs.pop("p")
    d.seqs["p"] = SyntheticSequence("p", d.seqs.pop("p").tokens, [])
    d.forced = {"p": forced.tokens[len(before.tokens):]}
    d.prefill(chunk)
    for _ in range(steps - len(before.tokens) - 1):
        d.step()
    return before + d.runs["p"]


def _sampled(runner, prompts: dict[str, list[int]], steps: int, first_block: int) -> dict[str, list[int]]:
    d = StepDriver(runner, first_block)
    for i, (seq_id, prompt) in enumerate(prompts.items()):
        d.add(seq_id, prompt, temperature=1.0, top_p=0.95, seed=1000 + i)
    d.step()
    for _ in range(steps - 1):
        d.step()
    return {k: s.samples for k, s in d.seqs.items()}


def _verdict(report: Report, item: str, a: Agreement, bound: float) -> None:
    report.add("correct", item, "yes" if not a.mismatches else "NO",
               a.describe(bound) + ("" if not a.mismatches else "; " + "; ".join(a.mismatches[:2])), **a.__dict__)
    if a.mismatches:
        report.fail(f"engine correctness: {item}")


def reference_runner(plan: Plan, device, hf_cfg: dict, num_kv_blocks: int):
    """The float32 engine on the PyTorch reference backend with exactly the tested engine's weights."""
    from services.engine.config import EngineConfig
    from services.engine.model_loader import RANDOM_DRAW_DTYPE
    from services.engine.model_runner import ModelRunner

    config = EngineConfig(dtype="float32", device=device.type, block_size=16, num_kv_blocks=num_kv_blocks,
                          max_model_len=plan.max_model_len, attention_backend="reference", enforce_eager=True,
                          max_num_seqs=8)
    return ModelRunner(config, random_weights={**hf_cfg, RANDOM_DRAW_DTYPE: plan.dtype})


def check_engine_correctness(report: Report, plan: Plan, device, name: str, hf_cfg: dict) -> None:
    from services.engine.config import EngineConfig
    from services.engine.cuda_graphs import FakeGraphCapture
    from services.engine.model_runner import ModelRunner

    rng = random.Random(7)
    vocab = hf_cfg["vocab_size"]
    long_len, steps, batch = 6 * plan.prompt_len // 8 + 5, plan.decode_steps // 2 + 2, 4
    prompts = {f"g{i}": [rng.randrange(vocab) for _ in range(plan.prompt_len // 4 + 7 * i)] for i in range(batch)}
    prompt = [rng.randrange(vocab) for _ in range(long_len)]
    chunk = max(16, plan.prompt_len // 4)
    per_run = batch * -(-(plan.prompt_len + steps + 16) // 16) + 4
    bound = LOGIT_BOUND[plan.dtype]

    # The reference first, then freed: on the GPU the two engines need not fit at once.
    reference = reference_runner(plan, device, hf_cfg, 2 * per_run)
    ref_batch = _greedy(reference, prompts, steps, 0)
    ref_long = _greedy(reference, {"r": prompt}, steps, per_run)
    del reference
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()

    config = EngineConfig(dtype=plan.dtype, device=device.type, block_size=16, num_kv_blocks=8 * per_run,
                          max_model_len=plan.max_model_len, attention_backend="triton", enforce_eager=True,
                          max_num_seqs=8)
    runner = ModelRunner(config, random_weights=hf_cfg)
    report.add("correct", f"engine: {name}, Triton backend, {plan.dtype}", "-",
               f"against float32 on the reference backend, same weights; bound {bound:g} x the row's RMS")
    graphs = runner.capture_decode_graphs(None if device.type == "cuda" else FakeGraphCapture())
    runner.graphs = graphs
    kind = "CUDA graphs" if device.type == "cuda" else "fake graphs"
    _verdict(report, f"greedy batch {batch}, {kind} (captured size)",
             compare(ref_batch, _greedy(runner, prompts, steps, 0, forced=ref_batch), bound), bound)
    runner.graphs = None
    _verdict(report, f"greedy batch {batch}, eager",
             compare(ref_batch, _greedy(runner, prompts, steps, per_run, forced=ref_batch), bound), bound)
    _verdict(report, "whole prefill", compare(
        ref_long, _greedy(runner, {"r": prompt}, steps, 2 * per_run, forced=ref_long), bound), bound)
    _verdict(report, f"prefill in chunks of {chunk}", compare(
        ref_long, _greedy(runner, {"r": prompt}, steps, 3 * per_run, chunk=chunk, forced=ref_long), bound), bound)
    _verdict(report, "prefix hit", compare(
        ref_long, {"r": _prefix_hit(runner, prompt, steps, 4 * per_run, ref_long["r"])}, bound), bound)
    _verdict(report, "preempted and recomputed", compare(
        ref_long, {"r": _preempted(runner, prompt, steps, 5 * per_run, chunk, ref_long["r"])}, bound), bound)

    first, second = (_sampled(runner, prompts, steps, (6 + i) * per_run) for i in range(2))
    same = first == second
    report.add("correct", "seeded sampling (T=1, top-p 0.95) twice", "same" if same else "DIFFERENT",
               f"{sum(map(len, first.values()))} tokens in {batch} sequences")
    if not same:
        report.fail("engine correctness: seeded sampling not reproducible")
