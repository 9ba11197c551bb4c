"""The engine: model weights, KV cache tensors and one forward pass per step. No scheduling here."""
