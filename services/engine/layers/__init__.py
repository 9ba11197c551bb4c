"""Shared building blocks of the model families (services/engine/models/): norms, rotary embeddings,
activations. Plain tensor functions and small classes, no nn.Module machinery on the hot path."""
