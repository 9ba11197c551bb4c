"""Speculative decoding on the scheduler's side: n-gram drafts, which drafts a step carries (the turn-down
rule), each sequence's draft state, and the counters vLLM exports. No torch here."""
