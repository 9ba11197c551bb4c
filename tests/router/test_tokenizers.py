"""The router's per-model tokenizers: one fetch per digest however many requests wait on it, and a
registry that cannot be read is a 503 to retry, never a 500."""

from __future__ import annotations

import asyncio

import pytest

from services.openai_api.errors import APIError
from services.router.tokenizers import ModelTokenizers


class Registry:
    def __init__(self, bundles: dict[str, bytes], fail: bool = False):
        self.bundles, self.fail, self.reads = bundles, fail, 0

    async def tokenizer(self, digest: str) -> bytes | None:
        self.reads += 1
        await asyncio.sleep(0.01)
        if self.fail:
            raise TimeoutError("Timeout reading from 127.0.0.1:6379")
        return self.bundles.get(digest)


def test_one_fetch_per_digest_and_a_failing_registry_is_a_503(smol_tokenizer):
    async def go():
        registry = Registry({smol_tokenizer.digest: smol_tokenizer.bundle})
        tokenizers = ModelTokenizers(registry)
        texts = await asyncio.gather(*[tokenizers.get("m", smol_tokenizer.digest) for _ in range(8)])
        assert registry.reads == 1 and all(t is texts[0] for t in texts)
        assert texts[0].tokenizer.encode("hello") == smol_tokenizer.encode("hello")
        tokenizers.close()

        down = ModelTokenizers(Registry({}, fail=True))
        with pytest.raises(APIError) as err:
            await down.get("m", smol_tokenizer.digest)
        assert err.value.status == 503 and err.value.code == "registry_unavailable"
        down.close()

    asyncio.run(go())
