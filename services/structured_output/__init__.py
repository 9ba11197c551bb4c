"""Structured output (guided decoding): compiling constraints and each sequence's grammar state.

Torch-free: the router validates constraints with it, the scheduler keeps a matcher per sequence and
sends each constrained row's token mask through the step protocol, and the engine only applies masks.
What a request constrains its output to (`StructuredOutputsParams`) is part of the request
(`services.request.structured_outputs`).

- `compiler`: `GrammarCompiler`, constraints into llguidance grammars on its own threads (limits, LRU);
- `guide`: `SequenceGuide`, one sequence's matcher, advanced only on committed tokens.
"""
