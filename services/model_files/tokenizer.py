"""A served model's tokenizer: `tokenizers` plus the model's Jinja chat template, without transformers.

One class for the router (which tokenizes once and forwards ids), the scheduler (which detokenizes)
and the offline API. transformers imports torch, which would make every router and scheduler pay
seconds of start-up and hundreds of MB for a model they never run. Rendering follows transformers'
`apply_chat_template` (sandboxed Jinja, trim_blocks/lstrip_blocks, special tokens parsed, none added),
so the ids equal what transformers produces (a test holds them to it).

Rendered chats are encoded piecewise: the tokenizer splits its input at special tokens before anything
else, so the text between two special tokens encodes the same alone, and those pieces (system prompts
above all) repeat from request to request. A bounded cache of piece encodings takes the tokenizer off
the router's hot path. The equivalence is checked at start-up and the cache disabled if it fails.

A model may ship no chat template (a GGUF file without `tokenizer.chat_template`, a base model): it is
served for completions, and a chat request is refused with a message saying so (`NoChatTemplateError`).
Extra template variables (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) are passed to the
template as transformers passes them, never overriding the messages, tools or special tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path

from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise(message: str):
    raise ValueError(message)


class NoChatTemplateError(ValueError):
    """The model ships no chat template: chat requests cannot be rendered (completions can)."""


# Template variables the renderer sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                         "unk_token", "pad_token", "raise_exception", "strftime_now"})


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


# The files that make a tokenizer and its chat template: what a replica publishes for routers.
BUNDLE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_BUNDLE_BYTES = 64 * 1024 * 1024


def read_bundle(model_dir: str | Path) -> bytes:
    """The tokenizer files of `model_dir` as one canonical blob (sorted JSON of name -> text): its
    SHA-256 is the tokenizer's identity in the registry, so a router can verify what it fetched."""
    model_dir = Path(model_dir)
    files = {name: (model_dir / name).read_text(encoding="utf-8") for name in BUNDLE_FILES
             if (model_dir / name).exists()}
    return json.dumps(files, sort_keys=True, ensure_ascii=False).encode("utf-8")


def bundle_digest(bundle: bytes) -> str:
    return hashlib.sha256(bundle).hexdigest()


class ModelTokenizer:
    def __init__(self, model_dir: str | Path | None = None, bundle: bytes | None = None):
        """From a model directory, or from a bundle (read_bundle's blob) another process published."""
        if bundle is None:
            bundle = read_bundle(model_dir)
        if len(bundle) > MAX_BUNDLE_BYTES:
            raise ValueError(f"tokenizer bundle of {len(bundle)} bytes exceeds {MAX_BUNDLE_BYTES}")
        files = json.loads(bundle)
        self.bundle, self.digest = bundle, bundle_digest(bundle)
        if "tokenizer.json" not in files:
            raise ValueError(f"{model_dir or 'the tokenizer bundle'} has no tokenizer.json")
        self.fast = Tokenizer.from_str(files["tokenizer.json"])
        config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        template = files.get("chat_template.jinja") or config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        self.template_reads_tools = False
        self.template_source = template or ""
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            self._template = env.from_string(template)
            # A template that reads `tools` renders function definitions itself (as transformers passes them);
            # one that does not gets them through services.openai_api.tool_prompt's fallback block.
            self.template_reads_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
        self._where = str(model_dir or "the tokenizer bundle")
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                                  "pad_token")}
        self.vocab_size = self.fast.get_vocab_size()
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # long prompts are tokenized in worker threads
        self._splitter = self._special_splitter()
        if self._splitter is not None and (self._template is None or not self._piecewise_matches()):
            self._splitter = None

    _CACHE_PIECES = 4096

    def _special_splitter(self) -> re.Pattern | None:
        added = self.fast.get_added_tokens_decoder().values()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
            return None  # tokens that absorb neighbouring text: pieces would not encode independently
        alternatives = sorted((t.content for t in added), key=len, reverse=True)
        return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")

    def _piecewise_matches(self) -> bool:
        sample = [{"role": "system", "content": "Be precise. <|im_end|> is literal here"},
                  {"role": "user", "content": "  Hello\n\nworld ✓ 12345"},
                  {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": " trailing space "}]
        text = self.render_chat(sample)
        return self._encode_pieces(text) == self.fast.encode(text, add_special_tokens=False).ids

    def _encode_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._splitter.split(text)):
            if not piece:
                continue
            if i % 2:  # odd positions are the special tokens the pattern captured
                ids.append(self.fast.token_to_id(piece))
                continue
            with self._lock:
                cached = self._pieces.get(piece)
                if cached is not None:
                    self._pieces.move_to_end(piece)
            if cached is None:
                cached = self.fast.encode(piece, add_special_tokens=False).ids
                with self._lock:
                    self._pieces[piece] = cached
                    if len(self._pieces) > self._CACHE_PIECES:
                        self._pieces.popitem(last=False)
            ids.extend(cached)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level pieces such as 'Ġthe'), as vLLM's /tokenize."""
        return [self.fast.id_to_token(t) or "" for t in token_ids]

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The template's text. `template_kwargs`: extra variables (chat_template_kwargs); a ValueError
        names one that would replace a variable the renderer sets."""
        if self._template is None:
            raise NoChatTemplateError(f"{self._where} has no chat template (the model ships none): send the "
                                      "prompt as text to /v1/completions, or serve a copy of the model with a "
                                      "chat_template.jinja")
        extra = dict(template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_VARIABLES & set(extra))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {clash[0]!r}")
        if tools:
            extra["tools"] = tools
        return self._template.render(**{**extra, "messages": messages, "add_generation_prompt": add_generation_prompt,
                                        **self._special})

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs)
        if self._splitter is not None:
            return self._encode_pieces(text)
        return self.fast.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(token_ids, skip_special_tokens=skip_special_tokens)
