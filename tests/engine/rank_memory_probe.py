"""`python -m tests.engine.rank_memory_probe MODEL_DIR TP`: start an engine of TP ranks on a model in a
fresh process, run a prefill and a decode (every weight paged in), and print one JSON list: per rank
its weights, KV cache and the measured growth of its peak resident set since its loading began.
`write_random_llama` writes a model big enough that weights dominate a rank's memory."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from services.device_check.step_driver import StepDriver
from services.engine.config import EngineConfig
from services.engine.load_memory import peak_resident
from services.engine.tp_launch import start_runner
from tests.proc_children import child_pids, cmdline

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4)


def write_random_llama(out: Path) -> int:
    """An untied float32 Llama of SHAPE (about 170 MiB); returns its weights' bytes."""
    import torch
    from safetensors.torch import save_file

    c = SHAPE
    h, inter, head = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    t = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "lm_head.weight": rand(c["vocab_size"], h),
         "model.norm.weight": torch.ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kv = c["num_key_value_heads"] * head
        t.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                  p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                  p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                  p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                  p + "mlp.down_proj.weight": rand(h, inter)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dict(SHAPE, architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                                                     max_position_embeddings=512, tie_word_embeddings=False)))
    return sum(x.numel() * x.element_size() for x in t.values())


def _rank_pids() -> list[int]:
    """This process (rank 0), then its child ranks in rank order."""
    pids = {0: os.getpid()}
    for pid in child_pids(os.getpid()):
        argv = cmdline(pid) or []
        if b"engine-worker" in argv:
            pids[int(argv[argv.index(b"--tp-local-rank") + 1])] = pid
    return [pids[r] for r in sorted(pids)]


def main(model_dir: str, tp: int) -> None:
    runner = start_runner(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=8, tensor_parallel_size=tp,
                                       enforce_eager=True))
    driver = StepDriver(runner)
    driver.add("probe", list(range(1, 40)))
    driver.step()
    driver.step()
    rows = [{**dataclasses.asdict(m), "peak_growth_bytes": peak_resident(pid) - m.start_bytes}
            for m, pid in zip(runner.memory, _rank_pids(), strict=True)]
    runner.close()
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
