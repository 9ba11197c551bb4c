"""Verifying a row's draft tokens against the target model, exactly.

A row with k drafts d_1..d_k is computed as k + 1 query tokens in one forward pass (the prefill path:
causal attention over the paged history and the row itself), and the sampler draws one token after each
of its last k + 1 positions, t_0..t_k, each exactly as the non-speculative step at that position would:
its own output index (seeded noise is mixed from it), its own grammar mask (the scheduler computed it
with the drafts before it committed), the drafts before it in the penalties' history, the same
temperature, top-k, top-p, min_p and bans. The row commits t_0..t_a, where a is the first position at
which t_a != d_{a+1} (or k): every committed token is a draw from the target's distribution given the
tokens before it, so the output is distributed exactly as without speculation, and is the very same
token sequence for greedy rows and for seeded rows (same noise, same logits up to the kernel's rounding).

This is Leviathan et al.'s rejection rule for a draft that is one token, not a distribution (q = 1 at the
draft, as vLLM's rejection sampler treats n-gram and every draft without draft_probs): the draft is
accepted with probability p(d) (t == d), and on a rejection the committed token t is distributed as p
with d removed, renormalised (p - q)+ normalised. Drawing t once and comparing realises both at once.
Logprobs are the target's, of the committed token, at its position.
"""

from __future__ import annotations

from dataclasses import replace

from services.contracts.step_protocol import ModelRunnerOutput, ScheduledSequence
from services.engine.sampler import SampleRow


def _reads_history(p) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def draft_rows(s: ScheduledSequence, mask_bytes: int) -> list[SampleRow]:
    """The k + 1 sample rows of a row with k drafts, in position order."""
    k = s.num_draft_tokens
    drafts = s.token_ids[len(s.token_ids) - k:]
    masks = s.token_bitmask
    rows = []
    for i in range(k + 1):
        pen = s.penalties
        if pen is not None and i and _reads_history(pen):
            pen = replace(pen, output_token_ids=pen.output_token_ids + drafts[:i])
        mask = None if masks is None else masks[i * mask_bytes:(i + 1) * mask_bytes]
        rows.append(SampleRow(s.sampling, s.sample_index, s.output_index + i, s.banned_token_ids, mask, pen))
    return rows


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """Leading drafts the target's own tokens agree with (sampled has one more entry than drafts)."""
    a = 0
    for d, t in zip(drafts, sampled, strict=False):  # sampled holds one more
        if d != t:
            break
        a += 1
    return a


def commit_verified(result: ModelRunnerOutput, drafts: dict[str, list[int]]) -> None:
    """Cut each drafted row's k + 1 samples (and logprobs) to the tokens it commits."""
    for seq_id, d in drafts.items():
        tokens = result.sampled.get(seq_id)
        if tokens is None:
            continue
        keep = num_accepted(d, tokens) + 1
        del tokens[keep:]
        lps = result.logprobs.get(seq_id)
        if lps is not None:
            del lps[keep:]
