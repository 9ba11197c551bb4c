"""`bench throughput` and `bench before-after`: offline tokens/s of the `LLM` API against transformers and vLLM."""
