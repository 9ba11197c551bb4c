"""The MLP activations the families use, by the `hidden_act` / `hidden_activation` names of their
configs (transformers' ACT2FN spellings), applied to a fused gate/up buffer: `act(gate) * up`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, op for op.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


def gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """`act(gate) * up` of a fused [T, 2I] buffer (gate first, as the loader stacks them)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[name](gate) * up
