"""Rotary embeddings of the text model (SPEC §3 "RoPE convention").

Interleaved pairs: ``(x[2i], x[2i+1])`` is a complex number rotated by ``pos * w_i`` over the LAST
``rope_head_dim`` dims of each vector; the leading dims are left alone ("nope" part). Frequencies
``w_i = base^(-2i/rd)``; layers with compressed KV use ``compress_rope_theta`` with YaRN
interpolation (``Config.rope_params``), window-only layers plain ``rope_theta``. The rotation is
computed in fp32 and cast back to the input dtype. The attention output is de-rotated with the
conjugate (``inverse=True``) at the query positions.
"""
from __future__ import annotations

import math

import torch

from .config import Config


def inv_freq(cfg: Config, base: float, yarn: bool) -> torch.Tensor:
    """[rd/2] fp32 angular frequencies, YaRN-corrected when ``yarn``."""
    rd = cfg.rope_head_dim
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if yarn:
        def corr(rot):  # the dimension whose wavelength makes `rot` turns over original_seq_len
            return rd * math.log(cfg.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_angles(cfg: Config, layer_id: int, positions: torch.Tensor) -> torch.Tensor:
    """positions int [...] -> complex64 [..., rd/2] rotations ``exp(i * pos * w)`` for layer ``layer_id``."""
    base, yarn = cfg.rope_params(layer_id)
    f = inv_freq(cfg, base, yarn).to(positions.device)
    ang = positions.to(torch.float32)[..., None] * f
    return torch.polar(torch.ones_like(ang), ang)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rd dims of x [..., n, d] (or [..., d]) by rot [..., rd/2] broadcastable.

    ``rot`` is given per position; for a head axis between positions and dims pass
    ``rot[..., None, :]``. Returns a new tensor in x's dtype.
    """
    rd = rot.shape[-1] * 2
    nope, pe = x[..., :-rd], x[..., -rd:]
    z = torch.view_as_complex(pe.float().unflatten(-1, (-1, 2)).contiguous())
    z = z * (rot.conj() if inverse else rot)
    pe = torch.view_as_real(z).flatten(-2).to(x.dtype)
    return torch.cat([nope, pe], dim=-1)
