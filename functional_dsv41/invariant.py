"""Batch-invariant numerics: the same bits for a token whatever else is computed with it.

On the CPU, the result of an fp32 matmul, or of a SIMD transcendental (sigmoid, silu, softplus),
can depend on how many values are processed together: BLAS switches kernels for few rows, and a
vectorised elementwise kernel runs the tail that does not fill a SIMD vector through a scalar
implementation with other last-ulp rounding. A one-token decode step then differs in the last ulp
from the same token inside a prefill, and the fp4/fp8 rounding and top-k choices downstream can turn
that ulp into another expert or index choice. These wrappers pad the work to a fixed granularity so
that every value takes the same path; they change nothing on other devices.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_ROWS = 8       # fp32 GEMM rows: multiples of 8 keep MKL on one kernel
_VALUES = 64    # elementwise: a multiple of every SIMD width (AVX2 8, AVX-512 16 fp32 lanes)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias) with each output row independent of the number of rows (CPU)."""
    if x.device.type != "cpu":
        return F.linear(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    pad = (-x2.shape[0]) % _ROWS
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    y = F.linear(x2, w)
    return (y[:y.shape[0] - pad] if pad else y).reshape(*lead, w.shape[0])


def ordered_sum(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` as explicit adds in index order: the same bits whatever the other dims (a
    reduction kernel may vectorise a short sum differently for one token than for many)."""
    parts = t.unbind(dim)
    acc = parts[0]
    for x in parts[1:]:
        acc = acc + x
    return acc.unsqueeze(dim) if keepdim else acc


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, every value computed on the SIMD path (CPU)."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _VALUES
    if not pad:
        return fn(x)
    return fn(torch.cat([flat, flat.new_zeros(pad)]))[:flat.numel()].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.softplus, x)
