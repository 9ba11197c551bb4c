"""A model-free engine for scheduler tests: it stores token ids in KV "slots" and checks them.

Each step it verifies that every position a sequence attends to holds that sequence's own token (so
block tables, prefix sharing and copy-on-write are right), applies block copies, and returns a token
that depends on the whole context: recomputation after preemption must reproduce it exactly.

With `kv_group_windows` it is a model with KV groups (sliding-window layers): each group's table is
checked and written on its own, a sliding group only over the positions its window sees, so a block
the scheduler released too early, or a prefix hit missing part of a window, fails the step.
"""

from __future__ import annotations

from services.contracts.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput, TokenLogprobs

EOS = 3


def allowed_ids(bitmask: bytes, limit: int | None = None) -> list[int]:
    """The token ids a packed mask allows, lowest first (at most `limit`)."""
    ids = []
    for w, word in enumerate(memoryview(bitmask).cast("I")):
        while word:
            low = word & -word
            ids.append(w * 32 + low.bit_length() - 1)
            if limit is not None and len(ids) >= limit:
                return ids
            word ^= low
    return ids


def allowed_choice(bitmask: bytes, draw: int) -> int:
    """A structured-output row: one of the lowest allowed ids (single characters and short pieces in a BPE
    vocabulary, so strings close and numbers end soon), chosen by `draw`, a function of the context."""
    ids = allowed_ids(bitmask, 24)
    return ids[draw % len(ids)] if ids else -1


class ShadowExecutor:
    """`copying`: the next token repeats what followed the last token's previous occurrence (so n-gram drafts
    are often right), otherwise a hash of the context. Rows with drafts are verified as the engine does:
    the token after each position is computed, and drafts are kept while they agree."""

    def __init__(self, num_blocks: int, block_size: int = 4, vocab_size: int = 1000, max_model_len: int = 4096,
                 copying: bool = False, kv_group_windows: list[int] | None = None):
        self.info = EngineInfo("shadow", block_size, num_blocks, max_model_len, vocab_size, "float32", "cpu", [EOS],
                               kv_group_windows=list(kv_group_windows or [0]))
        self.slots: dict[int, int] = {}
        self.history: dict[str, list[int]] = {}
        self.steps: list[SchedulerOutput] = []
        self.on_execute = None  # test hook, called with each SchedulerOutput before it runs
        self.eos_after: dict[str, int] = {}  # seq_id -> emit EOS once this many tokens exist
        self.lookup = None  # seq_id -> the scheduler's token list (to check prefix-cache hits)
        self.copying = copying
        self.drafts_seen = self.drafts_kept = 0

    def handshake(self) -> EngineInfo:
        return self.info

    def next_token(self, context: list[int]) -> int:
        h = (sum(context) * 7 + len(context) * 13) % (self.info.vocab_size - 10) + 10
        body = context[:-1]  # every caller appends the sample index to the tokens
        if self.copying and len(body) > 1 and h % 5:  # one token in five breaks the pattern
            last = body[-1]
            for i in range(len(body) - 2, -1, -1):
                if body[i] == last:
                    return body[i + 1]
        return h

    def top_logprobs(self, context: list[int], token: int, k: int) -> TokenLogprobs:
        """k distinct alternatives with context-dependent logprobs (beam search ranks them); EOS among
        them for some contexts, so beams also end."""
        h = self.next_token(context)
        ids = [token] + [(token + 37 * i - 10) % (self.info.vocab_size - 10) + 10 for i in range(1, k)]
        if h % 3 == 0:
            ids[h % k] = EOS
        lps = [-0.1 - 0.4 * i - (h % 11) * 0.05 * (i > 0) for i in range(k)]
        return TokenLogprobs(lps[0], ids, lps)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.on_execute:
            self.on_execute(out)
        self.steps.append(out)
        bs = self.info.block_size
        for src, dst in out.blocks_to_copy:
            for off in range(bs):
                if src * bs + off in self.slots:
                    self.slots[dst * bs + off] = self.slots[src * bs + off]
        result = ModelRunnerOutput(out.step_id)
        for s in out.sequences:
            hist = self.history.setdefault(s.seq_id, [])
            if s.start_pos > len(hist) and self.lookup is not None:
                hist[:] = self.lookup(s.seq_id)[:s.start_pos]  # a prefix hit: positions it never computed
            k = s.num_draft_tokens
            real, drafts = s.token_ids[:len(s.token_ids) - k], s.token_ids[len(s.token_ids) - k:]
            for i, tok in enumerate(real):
                p = s.start_pos + i
                if p < len(hist):
                    assert hist[p] == tok, f"{s.seq_id}: token at {p} changed"
                else:
                    assert p == len(hist), f"{s.seq_id}: gap before position {p}"
                    hist.append(tok)
            tables = [s.block_table, *s.group_block_tables]
            assert len(tables) == len(self.info.kv_group_windows), f"{s.seq_id}: one table per KV group"
            for g, (window, table) in enumerate(zip(self.info.kv_group_windows, tables, strict=True)):
                # The first new token sees start_pos - window + 1 onwards (everything without a window).
                for p in range(max(0, s.start_pos - window + 1) if window else 0, s.start_pos):
                    slot = table[p // bs] * bs + p % bs
                    assert self.slots.get(slot) == hist[p], (f"{s.seq_id}: KV group {g}'s KV at position {p} is "
                                                             f"not its own token")
                for i, tok in enumerate(s.token_ids):
                    p = s.start_pos + i
                    self.slots[table[p // bs] * bs + p % bs] = tok
            if s.sample and k:
                assert s.num_samples == 1
                ctx = hist[:s.start_pos + len(real)]
                mb = len(s.token_bitmask) // (k + 1) if s.token_bitmask is not None else 0
                toks = []
                for i in range(k + 1):
                    t = self.next_token(ctx + drafts[:i] + [0])  # as the plain path: context + [sample index]
                    if s.token_bitmask is not None:
                        t = allowed_choice(s.token_bitmask[i * mb:(i + 1) * mb], t)
                    elif len(ctx) + i + 1 >= self.eos_after.get(s.seq_id, 1 << 30):
                        t = EOS
                    toks.append(t)
                    if i == k or t != drafts[i]:
                        break
                self.drafts_seen += k
                self.drafts_kept += len(toks) - 1
                hist += drafts[:len(toks) - 1]  # the accepted drafts are committed at their positions
                result.sampled[s.seq_id] = toks
                if s.sampling.logprobs is not None:
                    result.logprobs[s.seq_id] = [TokenLogprobs(-0.5, [t], [-0.5]) for t in toks]
            elif s.sample:
                ctx = hist[:s.start_pos + len(s.token_ids)]
                toks = []
                for j in range(s.num_samples):
                    t = self.next_token(ctx + [j])
                    if s.token_bitmask is not None:
                        t = allowed_choice(s.token_bitmask, t)
                    elif len(ctx) + 1 >= self.eos_after.get(s.seq_id, 1 << 30):
                        t = EOS
                    toks.append(t)
                    if j:
                        self.history[f"{s.seq_id.split('#')[0]}#{s.sample_index + j}"] = list(ctx)
                result.sampled[s.seq_id] = toks
                if s.sampling.logprobs is not None:
                    k = s.sampling.logprobs
                    result.logprobs[s.seq_id] = [self.top_logprobs(ctx + [j], t, k) if k > 1
                                                 else TokenLogprobs(-0.5, [t], [-0.5]) for j, t in enumerate(toks)]
        return result

    def reset(self) -> None:
        self.slots.clear()

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass
