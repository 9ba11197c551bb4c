"""Seeded random PEFT LoRA adapters for tests, saved by PEFT itself, and PEFT + transformers references."""

from __future__ import annotations

from pathlib import Path

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8, alpha: int = 16,
                        use_rslora: bool = False, targets: list[str] | None = None, std: float = 0.3) -> Path:
    """A rank-`rank` adapter on `targets` (default: every projection) of the model in `model_dir`, with
    random A and B (PEFT's own initialisation leaves B zero: no effect to test), saved by save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_PROJECTIONS, lora_dropout=0.0,
                     use_rslora=use_rslora, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std / p.shape[-1] ** 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def peft_model(model_dir: Path, adapters: dict[str, Path]):
    """transformers' model with the adapters loaded by PEFT (switch with `set_adapter`)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


def peft_greedy(model, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, **kwargs)
    return out[0, len(prompt):].tolist()


def check_adapter_matches_peft(model_dir: Path, adapter: Path, reference, prompts: list[list[int]], what: str,
                               max_tokens: int = 8) -> None:
    """Serve `model_dir` with `adapter` as "A" (blocks of 4, chunks of 16, preemption forced) on prompts with
    and without it; each greedy output equals PEFT's `reference`, and the adapter changes the output."""
    from services import LLM, SamplingParams
    from tests.engine.models.test_families import ForcedPreemption

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=400,
              max_loras=1, max_lora_rank=8)
    llm.load_lora("A", str(adapter))
    llm.step_hook = ForcedPreemption()
    names = ["A", None, "A", "A"][:len(prompts)]
    outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=names)
    assert llm.core.scheduler.num_preemptions >= 1
    for p, n, o in zip(prompts, names, outs, strict=True):
        assert o.outputs[0].token_ids == peft_greedy(reference, n, p, max_tokens), f"{what}, adapter {n}"
    assert peft_greedy(reference, None, prompts[0], max_tokens) != outs[0].outputs[0].token_ids, \
        "the adapter must change the output"
