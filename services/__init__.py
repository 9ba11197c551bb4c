"""pagedserve: continuous batching over a paged KV cache, served as router, scheduler and engine.

`from services import LLM, SamplingParams, BeamSearchParams, StructuredOutputsParams` is the offline API; it loads
torch only when used.
"""

from services.request.beam_search_params import BeamSearchParams
from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.request.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "BeamSearchParams", "InvalidRequestError", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # Lazy, so that `import services` (routers, the CLI) does not pay for torch.
    if name == "LLM":
        from services.llm import LLM

        return LLM
    raise AttributeError(name)
