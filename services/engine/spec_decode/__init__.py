"""Speculative decoding on the engine's side: verifying drafts against the target (`verify`) and the
draft model that proposes them with its own paged KV cache (`draft_model`)."""
