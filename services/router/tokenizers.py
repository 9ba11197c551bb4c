"""Each served model's tokenizer, chat template and grammar compiler, learned from the registry.

A replica publishes its tokenizer files as one bundle under their SHA-256 (services.model_files.tokenizer), and names
that digest in its signed record. The router fetches a model's bundle the first time it routes to it,
checks it against the digest, and keeps it: routers need no copy of any model and no shared volume, and
a bundle that does not match its digest is never used. Models are told apart by digest, so two models
sharing one tokenizer share one entry, and a model redeployed with a new tokenizer gets a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from services.model_files.tokenizer import ModelTokenizer, bundle_digest
from services.openai_api.errors import APIError
from services.registry.model import PrefixIndex
from services.router.replicas import NoReplicasError
from services.structured_output.compiler import GrammarCompiler

log = logging.getLogger(__name__)

# Distinct tokenizers kept at once; digests come from signed records only, so this bounds a fleet's
# models, not an attacker's input.
MAX_TOKENIZERS = 64


@dataclass
class ModelText:
    """What the router needs of a model's vocabulary: its tokenizer and chat template, and a compiler of
    structured-output constraints (a constraint that can never compile is a 400 before routing)."""

    tokenizer: ModelTokenizer
    grammars: GrammarCompiler

    @classmethod
    def of(cls, tokenizer: ModelTokenizer) -> ModelText:
        return cls(tokenizer, GrammarCompiler(lambda: tokenizer.fast.to_str(), tokenizer.vocab_size))


class ModelTokenizers:
    def __init__(self, index: PrefixIndex, local: ModelTokenizer | None = None):
        """`local`: a tokenizer this process already has (`pagedserve serve`, or a router's --model), used
        for any model whose digest it matches and for replicas that publish none (older versions)."""
        self.index = index
        self.local = ModelText.of(local) if local is not None else None
        self._known: OrderedDict[str, ModelText] = OrderedDict()
        if self.local is not None:
            self._known[local.digest] = self.local
        self._loading: dict[str, asyncio.Task] = {}

    async def get(self, model: str, digest: str) -> ModelText:
        if not digest:
            if self.local is None:
                raise APIError(503, f"the replicas of {model} publish no tokenizer and this router has none "
                               "(start it with --model, or upgrade the replicas)", "model", "no_tokenizer")
            return self.local
        known = self._known.get(digest)
        if known is not None:
            self._known.move_to_end(digest)
            return known
        task = self._loading.get(digest)
        if task is None:  # one fetch per digest, however many requests wait on it
            task = asyncio.create_task(self._fetch(model, digest))
            self._loading[digest] = task
            task.add_done_callback(lambda _: self._loading.pop(digest, None))
        return await asyncio.shield(task)

    async def _fetch(self, model: str, digest: str) -> ModelText:
        try:
            bundle = await self.index.tokenizer(digest)
        except Exception as exc:  # the registry is down or slow: the next request tries again
            log.warning("could not read the tokenizer of %s from the registry (%s: %s)", model,
                        type(exc).__name__, exc)
            raise APIError(503, f"the tokenizer of {model} could not be read from the registry; retry",
                           code="registry_unavailable", headers={"Retry-After": "1"}) from None
        if bundle is None:  # its replica registered a moment before its bundle landed (or Redis lost it)
            raise NoReplicasError(f"the tokenizer of {model} is not in the registry yet")
        if bundle_digest(bundle) != digest:
            log.error("tokenizer bundle of %s in the registry does not match its digest %s; not using it",
                      model, digest)
            raise APIError(503, f"the tokenizer of {model} in the registry does not match its digest",
                           code="tokenizer_mismatch")
        text = ModelText.of(await asyncio.to_thread(ModelTokenizer, None, bundle))
        log.info("learned the tokenizer of %s from the registry (%s, vocabulary %d)", model, digest[:12],
                 text.tokenizer.vocab_size)
        self._known[digest] = text
        while len(self._known) > MAX_TOKENIZERS:
            _, old = self._known.popitem(last=False)
            if old is not self.local:
                old.grammars.close()
        return text

    def close(self) -> None:
        for text in self._known.values():
            text.grammars.close()
        for task in self._loading.values():
            task.cancel()
