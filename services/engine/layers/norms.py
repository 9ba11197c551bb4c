"""RMSNorm in the two arithmetic orders checkpoints were trained with.

- Llama order (Llama, Mistral, Qwen2/3, Phi-3): normalise in float32, cast back to the model's dtype,
  then multiply by the weight in that dtype (transformers' LlamaRMSNorm).
- Gemma order: normalise in float32 and multiply by `(1 + w)` in float32 before casting back
  (Gemma2RMSNorm / Gemma3RMSNorm, whose stored weight is the offset from one); gpt-oss multiplies by w
  itself in float32 (GptOssRMSNorm).

`RMSNorm` holds what a forward needs: the weight already as the multiplier (`1 + w` precomputed in
float32 for Gemma), the epsilon and the order, so no branch on the family runs per call.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama order: `weight * normalised(x).to(x.dtype)`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_float_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma order: `(normalised(x) * weight).to(x.dtype)`, the product in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


class RMSNorm:
    """One norm's weight and rule. `offset_one`: the checkpoint stores w and the norm multiplies by 1 + w
    (Gemma), computed once here in float32; otherwise the weight is used as stored, in the model dtype."""

    __slots__ = ("weight", "eps", "float_weight")

    def __init__(self, weight: torch.Tensor, eps: float, offset_one: bool = False, float_product: bool = False):
        self.eps = eps
        # gpt-oss: `(w * normalised(x)).to(dtype)` with the product in float32, as Gemma's but without the offset.
        self.float_weight = offset_one or float_product
        self.weight = (1.0 + weight.float()) if offset_one else weight.float() if float_product else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_weight:
            return rms_norm_float_weight(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
