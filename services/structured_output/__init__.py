"""Structured output (guided decoding): constraints, their compilation, and each sequence's grammar state.

Torch-free: the router validates constraints with it, the scheduler keeps a matcher per sequence and
sends each constrained row's token mask through the step protocol, and the engine only applies masks.

- `params`: `StructuredOutputsParams`, what a request constrains its output to (validated sizes);
- `compiler`: `GrammarCompiler`, constraints into llguidance grammars on its own threads (limits, LRU);
- `guide`: `SequenceGuide`, one sequence's matcher, advanced only on committed tokens.
"""

from services.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
