"""The scheduler: request queues, KV block bookkeeping and the continuous-batching loop (no torch)."""
