"""pagedserve: continuous batching over a paged KV cache, served as router, scheduler and engine.

`from services import LLM, SamplingParams, BeamSearchParams` is the offline API; it loads torch only when used.
"""

from services.beam_search_params import BeamSearchParams
from services.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "BeamSearchParams", "InvalidRequestError", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that `import services` (routers, the CLI) does not pay for torch.
    if name == "LLM":
        from services.llm import LLM

        return LLM
    raise AttributeError(name)
