"""The public endpoint: OpenAI API, prefix-aware routing over the registry, retries, queueing, API keys."""
