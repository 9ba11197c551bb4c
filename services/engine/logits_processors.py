"""The rarer logits processors, batched over the rows that ask for them: logit bias, vLLM's repetition,
frequency and presence penalties, and min_p.

In vLLM's order (v1 sampler): the bias is added first, then the penalties, all on float32 logits before
the greedy argmax and before temperature; min_p comes after temperature and before top-k/top-p. The rule,
for token t of a row with prompt tokens P and output tokens O (count c_t in O):

    l_t += bias_t
    if t in P or t in O:  l_t = l_t / r if l_t > 0 else l_t * r        (repetition penalty r)
    l_t -= frequency * c_t + presence * [c_t > 0]

min_p then drops every token whose probability is below min_p x that of the most likely one.
Rows without a PenaltySpec never reach this module.
"""

from __future__ import annotations

from itertools import chain, repeat

import torch

from services.contracts.step_protocol import PenaltySpec


def _flat(device: torch.device, lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, entry) of every entry of every row's list, as two long tensors."""
    rows = list(chain.from_iterable(repeat(i, len(ids)) for i, ids in enumerate(lists)))
    ids = list(chain.from_iterable(lists))
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(ids, dtype=torch.long, device=device))


def apply_penalties(logits: torch.Tensor, specs: list[PenaltySpec]) -> torch.Tensor:
    """Bias and penalties applied, in place, to float32 `logits` [len(specs), vocab]; returns them."""
    dev = logits.device
    if any(s.bias_token_ids for s in specs):
        ri, ids = _flat(dev, [s.bias_token_ids for s in specs])
        values = torch.tensor(list(chain.from_iterable(s.bias_values for s in specs)), dtype=logits.dtype, device=dev)
        logits.index_put_((ri, ids), values, accumulate=True)
    pen = [i for i, s in enumerate(specs) if s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0]
    if not pen:
        return logits
    sub = [specs[i] for i in pen]
    rows = torch.tensor(pen, dtype=torch.long, device=dev)
    counts = torch.zeros((len(sub), logits.shape[1]), dtype=logits.dtype, device=dev)
    ri, ids = _flat(dev, [s.output_token_ids for s in sub])
    counts.index_put_((ri, ids), torch.ones(len(ids), dtype=logits.dtype, device=dev), accumulate=True)
    seen_out = counts > 0
    part = logits.index_select(0, rows)
    if any(s.repetition_penalty != 1.0 for s in sub):
        seen = seen_out.clone()
        ri, ids = _flat(dev, [s.prompt_token_ids for s in sub])
        seen[ri, ids] = True
        rep = torch.tensor([s.repetition_penalty for s in sub], dtype=logits.dtype, device=dev).unsqueeze(1)
        factor = torch.where(seen, rep, torch.ones_like(rep))
        part = torch.where(part > 0, part / factor, part * factor)
    freq = torch.tensor([s.frequency_penalty for s in sub], dtype=logits.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor([s.presence_penalty for s in sub], dtype=logits.dtype, device=dev).unsqueeze(1)
    part = part - freq * counts - pres * seen_out.to(logits.dtype)
    logits.index_copy_(0, rows, part)
    return logits


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Tokens below min_p x the top probability set to -inf, in place (rows with min_p 0 keep all)."""
    probs = torch.softmax(logits, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    threshold = top * torch.tensor(min_ps, dtype=probs.dtype, device=logits.device).unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))
