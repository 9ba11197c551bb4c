"""Tokenizer of a served model: encoding, chat templates, and a torch-free decoder for detokenization.

Shared by the router (which tokenizes once and forwards ids) and the scheduler (which detokenizes).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.fast: Tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.vocab_size = self.fast.get_vocab_size()
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(token_ids, skip_special_tokens=skip_special_tokens)
