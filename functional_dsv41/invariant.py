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

_ROWS = 64      # CPU GEMMs run as GEMMs of exactly this many rows (see linear_rows)
_VALUES = 64    # elementwise: a multiple of every SIMD width (AVX2 8, AVX-512 16 fp32 lanes)


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias) with each output row independent of the number of rows (CPU).

    The rows are padded to a multiple of ``_ROWS`` and multiplied ``_ROWS`` at a time, so every row goes
    through a GEMM of the same shape. Padding to a multiple of 8 rows in one call was enough on AVX2/AVX-512
    machines without AMX; on a Sapphire Rapids (AMX) machine MKL's sgemm also switches kernels between 8 and
    16 rows and between ~100 and ~200 rows at some (K, N) (and K-splits large calls), so a decode step's
    row differed in the last ulp from the same row in a prefill (2026-12-04). Same-shape calls are the
    invariant that holds on every machine tried (16, 32 and 64 rows all did, on 10 (K, N) shapes in fp32 and
    bf16); 64 rows keep MKL's larger kernels: a tiny training step runs 14% faster than with one unchunked call
    and 35% faster than in 16-row pieces, and a decode step's one row costs a 64-row GEMM."""
    if x.device.type != "cpu":
        return F.linear(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    pad = (-n) % _ROWS
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    y = torch.cat([F.linear(c, w) for c in x2.split(_ROWS)]) if x2.shape[0] > _ROWS else F.linear(x2, w)
    return y[:n].reshape(*lead, w.shape[0])


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
