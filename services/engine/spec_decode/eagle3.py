"""EAGLE-3 heads in the layout the published checkpoints use (yuhuili/EAGLE3-*, and the `layers.0.` naming
of later exports): one decoder layer over [input_layernorm(embed(token)), hidden_norm(hidden)] (its q/k/v
read 2 * hidden), `fc` fusing three of the target's hidden states ([3 * target hidden] -> hidden), a final
`norm`, an `lm_head` over a draft vocabulary and `d2t` (draft id -> target id offset). Its embedding is
the target's unless the checkpoint has its own.

The target keeps the residual stream entering three of its layers (the config's
eagle_aux_hidden_state_layer_ids, else vLLM's default 2, L/2, L-3) for every token of a step. After the
target's verification the head runs over the step's committed positions: at position p the token after
it, t(p+1), with the target's fused hidden state at p, so its KV, like the target's, is valid at every
committed position (prefix hits, copy-on-write and preemption hold through the shared block tables). The
last row's output is the first proposal; each further one feeds the head its own pre-norm output. A chunk
of a prompt that does not end it needs the prompt's next token: the scheduler sends it
(`ScheduledSequence.next_prompt_token`). Where the next token is not one (the step an n > 1 prompt forks),
the head skips the prompt's last position: a draft that reads less, never an output that differs.

What is refused by name: more than one decoder layer, heads without `fc` (use_aux_hidden_state false), a
hidden size or vocabulary other than the target's, and tensor parallelism.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from services.contracts.step_protocol import ModelRunnerOutput, SamplingSpec, ScheduledSequence, SchedulerOutput
from services.engine.attention import PagedAttention
from services.engine.layers.norms import rms_norm
from services.engine.layers.rotary import RotaryEmbedding
from services.engine.linear import make_linear_factory
from services.engine.model_loader import Checkpoint, model_spec
from services.engine.models.decoder import DecoderModel
from services.engine.spec_decode.draft_model import PagedDraftCache
from services.engine.step_inputs import StepInputs
from services.model_files.model_source import resolve_model

ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator"}
_GREEDY = SamplingSpec()


def _refuse(message: str) -> ValueError:
    return ValueError(f"speculative_config.model (eagle3): {message}")


def aux_layer_ids(cfg: dict, target_layers: int) -> tuple[int, ...]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < target_layers for i in ids):
        raise _refuse(f"eagle_aux_hidden_state_layer_ids {list(ids)} must be three layers in [0, {target_layers})")
    return ids


class Eagle3Head:
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, backend: str, target: DecoderModel):
        self.model_dir = Path(resolve_model(path))
        cfg = json.loads((self.model_dir / "config.json").read_text())
        if not set(cfg.get("architectures") or []) & ARCHITECTURES:
            raise _refuse(f"architectures {cfg.get('architectures')} is not an EAGLE-3 head "
                          f"({', '.join(sorted(ARCHITECTURES))})")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise _refuse(f"{cfg['num_hidden_layers']} decoder layers: heads of one layer are implemented")
        if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise _refuse("use_aux_hidden_state false (no fc over the target's hidden states) is not implemented")
        tc = target.config
        hidden = cfg["hidden_size"]
        if cfg.get("target_hidden_size", hidden) != tc.hidden_size or hidden != tc.hidden_size:
            raise _refuse(f"hidden size {hidden} (target_hidden_size {cfg.get('target_hidden_size')}) against the "
                          f"target's {tc.hidden_size}")
        if cfg.get("vocab_size", tc.vocab_size) != tc.vocab_size:
            raise _refuse(f"vocabulary {cfg['vocab_size']} against the target's {tc.vocab_size}")
        # The head's layer is a Llama layer: its config read (and audited) as one.
        self.config = model_spec({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                  "num_hidden_layers": 1, "vocab_size": tc.vocab_size})
        c = self.config
        if c.layers[0].window is not None:
            raise _refuse("a sliding window on the head's layer is not implemented")
        self.aux_layers = aux_layer_ids(cfg, tc.num_layers)
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        self.device, self.dtype = device, dtype
        self.num_kv_heads = c.num_kv_heads
        ck = Checkpoint(self.model_dir)
        prefix = "midlayer." if "midlayer.input_layernorm.weight" in ck else "layers.0."

        def w(name: str, full: bool = False) -> torch.Tensor:
            return ck.read(name if full else prefix + name).to(device=device, dtype=dtype)

        linear = make_linear_factory(device, dtype)
        qkv = torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
        if qkv.shape[1] != 2 * hidden:
            raise _refuse(f"q/k/v read {qkv.shape[1]} features, not 2 * hidden = {2 * hidden}")
        self.qkv, self.o = linear(qkv), linear(w("self_attn.o_proj.weight"))
        self.gate_up = linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.down = linear(w("mlp.down_proj.weight"))
        self.input_norm, self.hidden_norm = w("input_layernorm.weight"), w("hidden_norm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        self.norm = w("norm.weight", True)
        fc = w("fc.weight", True)
        if tuple(fc.shape) != (hidden, 3 * tc.hidden_size):
            raise _refuse(f"fc is {tuple(fc.shape)}, not (hidden, 3 * target hidden) = {(hidden, 3 * tc.hidden_size)}")
        self.fc = linear(fc)
        head = w("lm_head.weight", True)
        draft_vocab = cfg.get("draft_vocab_size") or head.shape[0]
        if head.shape[0] != draft_vocab:
            raise _refuse(f"lm_head has {head.shape[0]} rows, draft_vocab_size is {draft_vocab}")
        self.lm_head = linear(head)
        d2t = ck.read("d2t").to(device=device, dtype=torch.long) if "d2t" in ck else torch.zeros(
            draft_vocab, dtype=torch.long, device=device)
        self.draft_to_target = torch.arange(draft_vocab, device=device) + d2t
        if d2t.shape[0] != draft_vocab or int(self.draft_to_target.max()) >= tc.vocab_size:
            raise _refuse("d2t must map each of the draft vocabulary's ids into the target's vocabulary")
        self.embed = w("embed_tokens.weight", True) if "embed_tokens.weight" in ck else target.embed
        self.rope = RotaryEmbedding(c.layers[0].rope, c.max_position_embeddings, device)
        self.attn = PagedAttention(backend, device)
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states at a position, fused into the head's input."""
        return self.fc(aux)

    def forward(self, step: StepInputs, hidden: torch.Tensor, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """(target-vocabulary argmax of the sampled rows, pre-norm output of every row)."""
        c = self.config
        t = step.upload(self.device)
        meta = step.attention_metadata(t, self.attn, self.num_kv_heads)
        eps = c.rms_norm_eps
        T = hidden.shape[0]
        embeds = rms_norm(F.embedding(t.input_ids, self.embed), self.input_norm, eps)
        normed = rms_norm(hidden, self.hidden_norm, eps)
        residual = normed if self.norm_before_residual else hidden
        qkv = self.qkv(torch.cat([embeds, normed], dim=-1))
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = self.rope(t.positions, q.view(T, c.num_heads, c.head_dim), k.reshape(T, c.num_kv_heads, c.head_dim))
        o = self.attn(q, k, v.reshape(T, c.num_kv_heads, c.head_dim), kv_caches[0][0], kv_caches[0][1], meta,
                      c.head_dim ** -0.5)
        residual = residual + self.o(o.reshape(T, self.q_size))
        gate, up = self.gate_up(rms_norm(residual, self.post_norm, eps)).chunk(2, dim=-1)
        prenorm = residual + self.down(F.silu(gate) * up)
        rows = prenorm.index_select(0, t.sample_idx)
        draft_ids = self.lm_head(rms_norm(rows, self.norm, eps)).float().max(dim=-1).indices
        return self.draft_to_target[draft_ids], prenorm


class Eagle3Drafter(PagedDraftCache):
    """An EAGLE-3 head with its own paged KV cache (one layer), following the target's committed tokens."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, backend: str, target: DecoderModel,
                 num_tokens: int):
        self.head = Eagle3Head(path, dtype, device, backend, target)
        super().__init__(self.head.config, self.head.num_kv_heads, dtype, device, num_tokens)
        self.model_dir = self.head.model_dir
        self.target = target
        target.aux_layers = self.head.aux_layers

    def _run(self, seqs: list[ScheduledSequence], hidden_of) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        """One forward over `seqs`; `hidden_of(seq_id, n)` gives each row's n input hidden states."""
        step = self.builder.build(SchedulerOutput(step_id=0, sequences=seqs))
        order = sorted(step.token_offsets.items(), key=lambda kv: kv[1])
        by_id = {s.seq_id: s for s in seqs}
        hidden = torch.cat([hidden_of(seq_id, len(by_id[seq_id].token_ids)) for seq_id, _ in order])
        ids, prenorm = self.head.forward(step, hidden, self.kv_caches)
        ends = {seq_id: prenorm[off + len(by_id[seq_id].token_ids) - 1] for seq_id, off in order}
        return dict(zip(step.owners, ids.tolist(), strict=True)), ends

    @torch.inference_mode()
    def follow(self, out: SchedulerOutput, result: ModelRunnerOutput, target_step: StepInputs | None) -> None:
        self.apply_copies(out)
        aux = self.target.aux_hidden
        self.target.aux_hidden = None
        if target_step is None or aux is None:
            return
        rows, ends = [], {}
        for s in out.sequences:
            tokens = result.sampled.get(s.seq_id)
            k = s.num_draft_tokens
            committed = s.token_ids[:len(s.token_ids) - k] + (tokens[:-1] if k and tokens else [])
            if tokens and s.num_samples == 1:
                nxt = tokens[-1]
            elif not s.sample and s.next_prompt_token >= 0:
                nxt = s.next_prompt_token
            else:
                nxt = None  # the token after the last position is not one: skip that position
            shifted = committed[1:] + ([nxt] if nxt is not None else [])
            if not shifted:
                continue
            propose = s.propose_draft_tokens > 0 and nxt is not None and bool(tokens)
            rows.append(ScheduledSequence(s.seq_id, shifted, s.start_pos, s.block_table, propose, _GREEDY))
            if propose:
                ends[s.seq_id] = (s, s.start_pos + len(shifted))  # where the first proposal is fed back
        if not rows:
            return
        offsets = target_step.token_offsets
        fused = self.head.combine(aux)
        last, state = self._run(rows, lambda seq_id, n: fused[offsets[seq_id]:offsets[seq_id] + n])
        drafts = {seq_id: [tok] for seq_id, tok in last.items()}

        def forward(feed: list[ScheduledSequence]) -> dict[str, int]:
            nonlocal state
            prev = state  # each row's pre-norm output: the hidden state its next token is fed with
            new, state = self._run(feed, lambda seq_id, n: prev[seq_id][None])
            return new

        self.extend(drafts, ends, forward)
        result.draft_token_ids.update(drafts)
