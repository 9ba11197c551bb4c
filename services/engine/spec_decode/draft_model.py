"""The draft model: a smaller model with the target's vocabulary that proposes draft tokens, with its own
paged KV cache indexed by the scheduler's block tables.

Its cache has the target's blocks (same ids, same block size; its own layers, heads and head size), so
the scheduler's one set of tables covers both: prefix-cache hits, copy-on-write, preemption and freed
blocks hold for the draft's KV exactly as for the target's. The invariant that makes that true: after
every step the draft's KV is valid at every position the target's is (the committed tokens), because
after the target's verification the draft runs over exactly the tokens the step committed:

1. one forward over every row's committed tokens of this step (prompt chunks, each decode's token and
   the drafts the target kept) plus, for rows asked to propose, the token the target just sampled, whose
   logits give the first proposal;
2. one single-token forward per further proposal, for the rows still proposing.

What step 2 writes lies past the committed tokens (in slots the scheduler allocated ahead, given back
after the step) and is rewritten before anything reads it as committed. Proposals are the draft's argmax
(as vLLM's draft-model and EAGLE proposers): the target's verification keeps the output exact whatever
they are, so a draft of random weights only makes speculation slower, never different.
"""

from __future__ import annotations

import logging

import torch

from services.contracts.step_protocol import ModelRunnerOutput, SamplingSpec, ScheduledSequence, SchedulerOutput
from services.engine.model_loader import load_model
from services.engine.models.registry import MODULE_PATH
from services.engine.step_inputs import StepInputBuilder
from services.engine.step_validation import StepLimits
from services.model_files.model_source import resolve_model

log = logging.getLogger(__name__)

_GREEDY = SamplingSpec()


class PagedDraftCache:
    """A drafter's own paged KV cache over the target's block ids (same block size; its own layers, heads
    and head size), and the step builder its forwards go through."""

    def __init__(self, config, num_kv_heads: int, dtype: torch.dtype, device: torch.device, num_tokens: int):
        self.config, self.num_kv_heads = config, num_kv_heads
        self.device, self.dtype = device, dtype
        self.num_tokens = num_tokens  # the most tokens it proposes per step
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.arena: torch.Tensor | None = None
        self.builder: StepInputBuilder | None = None
        self.max_model_len = 0

    def check_target(self, vocab_size: int, max_model_len: int) -> None:
        """The draft must speak the target's vocabulary and reach its context length."""
        cfg = self.config
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {cfg.vocab_size} tokens, the "
                             f"target's {vocab_size}: a draft model must share the target's tokenizer")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model: the draft reaches {cfg.max_position_embeddings} positions, "
                             f"fewer than the target's max_model_len {max_model_len}")

    def bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        return 2 * cfg.num_layers * block_size * self.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Its KV cache over the same block ids as the target's (zeroed: padding slots are read and masked)."""
        cfg = self.config
        shape = (cfg.num_layers, 2, num_blocks, block_size, self.num_kv_heads, cfg.head_dim)
        self.arena = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.arena[i, 0], self.arena[i, 1]) for i in range(cfg.num_layers)]
        self.builder = StepInputBuilder(StepLimits(block_size, num_blocks, max_model_len, cfg.vocab_size), self.device)
        self.max_model_len = max_model_len

    @property
    def cache_bytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def apply_copies(self, out: SchedulerOutput) -> None:
        """The step's copy-on-write pairs, in this cache too (before anything of the step writes)."""
        if out.blocks_to_copy:
            pairs = torch.tensor(out.blocks_to_copy, dtype=torch.long, device=self.device)
            self.arena.index_copy_(2, pairs[:, 1], self.arena.index_select(2, pairs[:, 0]))

    def reset(self) -> None:
        self.arena.zero_()

    def extend(self, drafts: dict[str, list[int]], ends: dict, forward) -> None:
        """Proposals 2..k: each proposing row's last proposal fed back, one token per forward
        (`forward(rows) -> {seq_id: next proposal}`); `ends[seq_id]` = (its scheduled row, the position
        its first proposal is fed at)."""
        for j in range(1, self.num_tokens):
            feed = []
            for seq_id, (s, pos) in ends.items():
                p = pos + j - 1
                if s.propose_draft_tokens > j and p < self.max_model_len and len(drafts[seq_id]) == j:
                    feed.append(ScheduledSequence(seq_id, [drafts[seq_id][-1]], p, s.block_table, True, _GREEDY))
            if not feed:
                return
            for seq_id, tok in forward(feed).items():
                drafts[seq_id].append(tok)


class DraftModel(PagedDraftCache):
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, backend: str, num_tokens: int):
        self.model_dir = resolve_model(path)
        self.model, _, path = load_model(self.model_dir, dtype, device, backend)
        if path != MODULE_PATH or self.model.kv_plan.num_groups != 1:
            # Its KV cache follows the target's one block table: one group of full-attention layers.
            raise ValueError(f"speculative_config.model: {self.model_dir} needs "
                             f"{'the transformers path' if path != MODULE_PATH else 'sliding-window KV groups'}; "
                             "a draft model must be a family module's model with full attention on every layer")
        super().__init__(self.model.config, self.model.num_kv_heads, dtype, device, num_tokens)

    def _forward(self, seqs: list[ScheduledSequence]) -> dict[str, int]:
        """One forward of the draft over `seqs`; the argmax after each row that samples."""
        step = self.builder.build(SchedulerOutput(step_id=0, sequences=seqs))
        t = step.upload(self.device)
        logits, _ = self.model.forward(t.input_ids, t.positions, [step.attention_metadata(
            t, self.model.attn, self.model.num_kv_heads)], self.kv_caches, t.sample_idx)
        if not step.rows:
            return {}
        return dict(zip(step.owners, logits[:len(step.rows)].float().max(dim=-1).indices.tolist(), strict=True))

    @torch.inference_mode()
    def follow(self, out: SchedulerOutput, result: ModelRunnerOutput, target_step=None) -> None:
        """Run over what the target committed in step `out` and put the proposals asked for into `result`."""
        self.apply_copies(out)
        rows, ends = [], {}
        for s in out.sequences:
            tokens = result.sampled.get(s.seq_id)
            k = s.num_draft_tokens
            committed = s.token_ids[:len(s.token_ids) - k]
            if k and tokens:
                committed = committed + tokens[:-1]  # the drafts the target kept
            propose = s.propose_draft_tokens > 0 and bool(tokens) and s.num_samples == 1
            if propose:
                committed = committed + tokens[-1:]
                ends[s.seq_id] = (s, s.start_pos + len(committed))  # where the first proposal goes
            rows.append(ScheduledSequence(s.seq_id, committed, s.start_pos, s.block_table, propose, _GREEDY))
        if not rows:
            return
        drafts = {seq_id: [tok] for seq_id, tok in self._forward(rows).items()}
        self.extend(drafts, ends, self._forward)
        result.draft_token_ids.update(drafts)
