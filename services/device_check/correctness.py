"""The GPU check's engine correctness section: what the device computes, not how fast.

On one engine (the plan's first model, random weights, the Triton backend in the plan's dtype):
- greedy tokens replayed from CUDA graphs equal eager execution at a captured batch size;
- a prefix hit (a sequence whose first blocks are another's, computed once), a prompt prefilled in
  chunks, and a sequence preempted and recomputed into fresh blocks each give the greedy tokens of the
  plain run;
- a seeded sampling run gives the same tokens twice.
Greedy runs are compared step by step on the logits themselves: where the tokens differ, the reference
run's top two logits must lie within a tolerance of each other (a near-tie that rounding decides, so both
tokens are right and the runs part there); any other difference is a failure. On the CPU dry run the
graphs are the fake capture, so the comparison logic runs there too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.device_check.report import Report
from services.device_check.step_driver import StepDriver, SyntheticSequence
from services.device_check.workload import Plan

# |logit difference| under which two candidates count as tied, by the engine's dtype.
TIE_TOLERANCE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.15}


@dataclass
class GreedyRun:
    """One sequence's greedy tokens and, per token, the logits row it was chosen from (float32, host)."""

    tokens: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)

    def __add__(self, other: GreedyRun) -> GreedyRun:
        return GreedyRun(self.tokens + other.tokens, self.logits + other.logits)


class LogitDriver(StepDriver):
    """A StepDriver that picks each token as the argmax of the logits and keeps those logits."""

    def __init__(self, runner, first_block: int = 0):
        super().__init__(runner, first_block)
        self.runs: dict[str, GreedyRun] = {}

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
            token = int(row.argmax())
            sampled[owner] = [token]
            run = self.runs.setdefault(owner, GreedyRun())
            run.tokens.append(token)
            run.logits.append(row)
        return sampled


@dataclass
class Agreement:
    steps: int = 0  # tokens compared
    equal: int = 0  # of which equal, up to each sequence's first difference
    ties: int = 0  # sequences that parted at a near-tie
    mismatches: list[str] = field(default_factory=list)
    max_logit_diff: float = 0.0  # over the steps both runs took from the same context

    def describe(self) -> str:
        return (f"{self.equal}/{self.steps} tokens equal, {self.ties} near-tie partings; "
                f"max |logit diff| {self.max_logit_diff:.2e}")


def compare(reference: dict[str, GreedyRun], other: dict[str, GreedyRun], tolerance: float) -> Agreement:
    """Step by step per sequence until the first difference (after it the contexts differ)."""
    a = Agreement()
    for seq_id, ref in reference.items():
        run = other.get(seq_id, GreedyRun())
        n = min(len(ref.tokens), len(run.tokens))
        a.steps += len(ref.tokens)
        if n < len(ref.tokens):
            a.mismatches.append(f"{seq_id}: {len(run.tokens)} tokens, not {len(ref.tokens)}")
        for i in range(n):
            r, o = ref.logits[i], run.logits[i]
            a.max_logit_diff = max(a.max_logit_diff, float((r - o).abs().max()))
            if ref.tokens[i] == run.tokens[i]:
                a.equal += 1
                continue
            gap = float(r[ref.tokens[i]] - r[run.tokens[i]])
            if gap <= tolerance:
                a.ties += 1
            else:
                a.mismatches.append(f"{seq_id} step {i}: {run.tokens[i]} instead of {ref.tokens[i]} "
                                    f"(logit gap {gap:.3f} > {tolerance})")
            break
    return a


def _greedy(runner, prompts: dict[str, list[int]], steps: int, first_block: int,
            chunk: int | None = None) -> dict[str, GreedyRun]:
    d = LogitDriver(runner, first_block)
    for seq_id, prompt in prompts.items():
        d.add(seq_id, prompt)
    d.prefill(chunk or sum(map(len, prompts.values())))
    for _ in range(steps - 1):
        d.step()
    return d.runs


def _prefix_hit(runner, prompt: list[int], steps: int, first_block: int) -> GreedyRun:
    """'a' computes the prompt; 'b', the same prompt, starts with a's full blocks (all but the block
    holding the last token, as a prefix cache hands them out) and computes only the rest."""
    d = LogitDriver(runner, first_block)
    d.add("a", prompt)
    d.step()
    shared = (len(prompt) - 1) // d.block_size
    d.seqs["b"] = SyntheticSequence("b", list(prompt), d.seqs["a"].table[:shared], computed=shared * d.block_size)
    for _ in range(steps):
        d.step({"a": 0})
    return d.runs["b"]


def _preempted(runner, prompt: list[int], steps: int, first_block: int, chunk: int) -> GreedyRun:
    """Decode part way, drop the sequence's blocks, recompute prompt + output in chunks into fresh blocks
    (as the scheduler does after a preemption), and decode on."""
    d = LogitDriver(runner, first_block)
    d.add("p", prompt)
    for _ in range(steps // 2):
        d.step()
    before = d.runs.pop("p")
    d.seqs["p"] = SyntheticSequence("p", d.seqs.pop("p").tokens, [])
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


def _verdict(report: Report, item: str, a: Agreement) -> None:
    report.add("correct", item, "yes" if not a.mismatches else "NO",
               a.describe() + ("" if not a.mismatches else "; " + "; ".join(a.mismatches[:2])), **a.__dict__)
    if a.mismatches:
        report.fail(f"engine correctness: {item}")


def check_engine_correctness(report: Report, plan: Plan, device, name: str, hf_cfg: dict) -> None:
    from services.engine.config import EngineConfig
    from services.engine.cuda_graphs import FakeGraphCapture
    from services.engine.model_runner import ModelRunner

    rng = random.Random(7)
    vocab = hf_cfg["vocab_size"]
    long_len, steps, batch = 6 * plan.prompt_len // 8 + 5, plan.decode_steps // 2 + 2, 4
    prompts = {f"g{i}": [rng.randrange(vocab) for _ in range(plan.prompt_len // 4 + 7 * i)] for i in range(batch)}
    per_run = batch * -(-(plan.prompt_len + steps + 16) // 16) + 4
    config = EngineConfig(dtype=plan.dtype, device=device.type, block_size=16, num_kv_blocks=8 * per_run,
                          max_model_len=plan.max_model_len, attention_backend="triton", enforce_eager=True,
                          max_num_seqs=8)
    runner = ModelRunner(config, random_weights=hf_cfg)
    tol = TIE_TOLERANCE[plan.dtype]
    report.add("correct", f"engine: {name}, Triton backend, {plan.dtype}", "-", f"logit tie tolerance {tol}")

    graphs = runner.capture_decode_graphs(None if device.type == "cuda" else FakeGraphCapture())
    runner.graphs = graphs
    replayed = _greedy(runner, prompts, steps, 0)
    runner.graphs = None
    eager = _greedy(runner, prompts, steps, 0)
    kind = "CUDA graphs" if device.type == "cuda" else "fake graphs"
    _verdict(report, f"greedy, {kind} == eager, batch {batch} (captured)", compare(eager, replayed, tol))

    prompt = [rng.randrange(vocab) for _ in range(long_len)]
    chunk = max(16, plan.prompt_len // 4)
    reference = _greedy(runner, {"r": prompt}, steps, per_run)
    _verdict(report, f"prefill in chunks of {chunk} == whole", compare(
        reference, _greedy(runner, {"r": prompt}, steps, 2 * per_run, chunk=chunk), tol))
    _verdict(report, "prefix hit == computed", compare(
        reference, {"r": _prefix_hit(runner, prompt, steps, 3 * per_run)}, tol))
    _verdict(report, "preempted and recomputed == uninterrupted", compare(
        reference, {"r": _preempted(runner, prompt, steps, 4 * per_run, chunk)}, tol))

    first, second = (_sampled(runner, prompts, steps, (5 + i) * per_run) for i in range(2))
    same = first == second
    report.add("correct", "seeded sampling (T=1, top-p 0.95) twice", "same" if same else "DIFFERENT",
               f"{sum(map(len, first.values()))} tokens in {batch} sequences")
    if not same:
        report.fail("engine correctness: seeded sampling not reproducible")
