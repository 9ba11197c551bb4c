"""The router's tokenizer: `tokenizers` plus the model's Jinja chat template, without transformers.

transformers imports torch, which would make every router pay seconds of start-up and hundreds of MB
for a model it never runs. Rendering follows transformers' `apply_chat_template` (sandboxed Jinja,
trim_blocks/lstrip_blocks, special tokens parsed, none added), so ids match the scheduler's.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise(message: str):
    raise ValueError(message)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class PromptTokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.fast = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        if (model_dir / "chat_template.jinja").exists():
            template = (model_dir / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise ValueError(f"{model_dir} has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        self._template = env.from_string(template)
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                  "pad_token")}
        self.vocab_size = self.fast.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.fast.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt)
        return self.fast.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(token_ids, skip_special_tokens=skip_special_tokens)
