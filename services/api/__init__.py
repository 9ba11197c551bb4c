"""The OpenAI HTTP layer of a model replica: request validation, SSE streaming, usage, errors."""
