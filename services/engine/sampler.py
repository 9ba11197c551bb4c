"""Token sampling for a batch of rows, each with its own parameters.

Greedy rows take the argmax; with half-precision logits on the CPU, candidates within one rounding
unit of the maximum are rescored in float32 from the final hidden state (kernels.cpu), so a bfloat16
tie never decides a greedy token and a greedy request's tokens do not depend on its batch.

Structured output: a row with a token mask (packed int32 words, a bit per token) picks among its
allowed tokens only. Greedy rows take a masked argmax (the C++ kernels on the CPU: nothing is written
over the vocabulary); random rows and rows that want logprobs get the disallowed logits set to -inf
first, so temperature, top-k, top-p and the logprobs all see the constrained distribution.

Random rows apply temperature, top-k and top-p, then draw with the exponential-race trick (argmax of
p / E, E ~ Exp(1)), which equals sampling from p. A row with a seed draws its noise from a generator
seeded by (seed, sample index, output index), so a seeded request gives the same tokens whatever else
is in the batch and even after preemption and recomputation.

Rows with a PenaltySpec (logit bias, penalties, min_p) go through services/engine/logits_processors.py
in float32 first; log-probabilities stay those of the model's own distribution (vLLM's raw logprobs).
Rows without one take exactly the path they took before it existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash

from kernels.token_bitmask import apply_token_bitmask, masked_argmax
from services.contracts.step_protocol import PenaltySpec, SamplingSpec, TokenLogprobs
from services.engine.logits_processors import apply_min_p, apply_penalties


@dataclass
class SampleRow:
    spec: SamplingSpec
    sample_index: int
    output_index: int
    banned: list[int] = field(default_factory=list)  # token ids this row may not pick (min_tokens)
    bitmask: bytes | None = None  # structured output: the allowed tokens, packed (None: all)
    penalties: PenaltySpec | None = None


def _bitmask(rows: list[SampleRow], device: torch.device) -> torch.Tensor | None:
    """The rows' masks as int32 [rows, words] (all ones for unconstrained rows), or None when none has one."""
    size = next((len(r.bitmask) for r in rows if r.bitmask is not None), None)
    if size is None:
        return None
    everything = b"\xff" * size
    packed = bytearray(b"".join(everything if r.bitmask is None else r.bitmask for r in rows))
    return torch.frombuffer(packed, dtype=torch.int32).view(len(rows), size // 4).to(device)


def _row_seed(seed: int, sample_index: int, output_index: int) -> int:
    digest = xxhash.xxh3_64_intdigest(f"{seed}:{sample_index}:{output_index}".encode())
    return digest & ((1 << 63) - 1)


class Sampler:
    def __init__(self, device: torch.device, fast_argmax=None, exact_argmax=None):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.seed()
        # CPU: argmax straight on half-precision logits (kernels.cpu), no float32 copy of the matrix;
        # exact_argmax(logits, hidden, head_weight) also rescores near-ties in float32.
        self._fast_argmax = fast_argmax
        self._exact_argmax = exact_argmax

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], hidden: torch.Tensor | None = None,
                 head_weight: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(rows), vocab], any float dtype; hidden: the final hidden state of those rows and
        head_weight the output embedding, for exact greedy on half-precision logits. Returns token ids
        and, where asked, log-probabilities."""
        n = len(rows)
        banned = [(i, r.banned) for i, r in enumerate(rows) if r.banned]
        if banned:
            vocab = logits.shape[1]
            for i, ids in banned:  # in place: these logits are this step's alone
                logits[i, torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long,
                                       device=logits.device)] = float("-inf")
        bitmask = _bitmask(rows, logits.device)
        # Temperatures too small to divide by are greedy (the scheduler already sends them as 0).
        # The scheduler floored tiny temperatures to 0 (services.request.limits.effective_temperature, once);
        # the step's validation refused any other temperature below the floor.
        greedy = [i for i, r in enumerate(rows) if r.spec.temperature == 0]
        rand = [i for i, r in enumerate(rows) if r.spec.temperature != 0]
        want = [i for i, r in enumerate(rows) if r.spec.logprobs is not None]
        # Rows whose logits a bias or penalty changes (min_p alone is applied in _sample, and greedy
        # rows ignore it: it never moves the argmax).
        adjusted = [i for i, r in enumerate(rows) if r.penalties is not None and r.penalties.adjusts_logits]
        if len(greedy) == n and not want and not adjusted:  # the common case: no float32 copy of the logits
            return self._greedy(logits, hidden, head_weight, bitmask).tolist(), [None] * n
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        adj = set(adjusted)
        adjusted_greedy = [i for i in greedy if i in adj]
        greedy = [i for i in greedy if i not in adj]
        if greedy:
            gi = torch.tensor(greedy, device=logits.device)
            rows_hidden = None if hidden is None else hidden.index_select(0, gi)
            tokens[gi] = self._greedy(logits.index_select(0, gi), rows_hidden, head_weight,
                                      None if bitmask is None else bitmask.index_select(0, gi))
        logits = logits.float()
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)  # rows without a mask are all ones: left as they are
        raw = logits  # what log-probabilities are taken from: the model's, constrained by bans and masks
        if adjusted:
            ai = torch.tensor(adjusted, device=logits.device)
            part = apply_penalties(logits.index_select(0, ai), [rows[i].penalties for i in adjusted])
            logits = logits.index_copy(0, ai, part)  # a copy: `raw` keeps the model's distribution
            if adjusted_greedy:
                agi = torch.tensor(adjusted_greedy, device=logits.device)
                tokens[agi] = logits.index_select(0, agi).max(dim=-1).indices
        if rand:
            ri = torch.tensor(rand, device=logits.device)
            tokens[ri] = self._sample(logits.index_select(0, ri), [rows[i] for i in rand])
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * n
        if want:
            wi = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(raw.index_select(0, wi), dim=-1)
            k = max(rows[i].spec.logprobs for i in want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1) if k else (None, None)
            chosen = lp.gather(1, tokens.index_select(0, wi).unsqueeze(1)).squeeze(1).tolist()
            for j, i in enumerate(want):
                kk = rows[i].spec.logprobs
                logprobs[i] = TokenLogprobs(
                    chosen[j],
                    top_i[j, :kk].tolist() if kk else [],
                    top_v[j, :kk].tolist() if kk else [],
                )
        return token_list, logprobs

    def _greedy(self, logits: torch.Tensor, hidden: torch.Tensor | None, head_weight: torch.Tensor | None,
                bitmask: torch.Tensor | None = None) -> torch.Tensor:
        if bitmask is not None:
            exact = self._exact_argmax is not None
            return masked_argmax(logits, bitmask, hidden if exact else None, head_weight if exact else None)
        if logits.dtype != torch.float32:
            if self._exact_argmax is not None and hidden is not None and head_weight is not None:
                return self._exact_argmax(logits.contiguous(), hidden.contiguous(), head_weight)
            if self._fast_argmax is not None:
                return self._fast_argmax(logits.contiguous())
        return logits.float().max(dim=-1).indices  # max() is several times faster than argmax() on the CPU

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([r.spec.temperature for r in rows], device=dev, dtype=torch.float32)
        logits = logits / temps.unsqueeze(1)
        min_ps = [r.penalties.min_p if r.penalties is not None else 0.0 for r in rows]
        if any(min_ps):
            logits = apply_min_p(logits, min_ps)
        top_ks = [r.spec.top_k for r in rows]
        top_ps = [r.spec.top_p for r in rows]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = self._filter(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.spec.seed is None]
        if unseeded:
            noise.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.spec.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(_row_seed(r.spec.seed, r.sample_index, r.output_index))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=logits.device).unsqueeze(1)
        drop = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p; the first always stays.
        before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_ps, device=logits.device, dtype=torch.float32).unsqueeze(1)
        drop |= before >= p
        # The top token always stays, whatever top_p rounds to in float32 (1e-50 is 0 there).
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
