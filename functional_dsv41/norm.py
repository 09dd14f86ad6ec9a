"""RMSNorm (SPEC §2): ``weight * (x_fp32 * rsqrt(mean(x^2) + eps))``, cast back to x's dtype.

Every norm of the text model uses ``cfg.norm_eps`` (1e-20 in the release: effectively no epsilon);
the ViT uses 1e-6.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] (bf16 or fp32), weight [d] -> [..., d] in x's dtype; statistics in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)
