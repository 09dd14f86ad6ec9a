"""Manifold-constrained hyper-connections (mHC), SPEC §2.

The residual stream is ``hc_mult`` (4) parallel copies ``h [b, s, hc, dim]``. Each sublayer computes
24 mixes from the whole flattened state with ONE RMS statistic, splits them (``hc_split_sinkhorn``)
into ``pre [hc]`` (collapse weights), ``post [hc]`` (how much of the sublayer output each stream
takes) and ``comb [hc, hc]`` (a near doubly-stochastic stream mixing, Sinkhorn-Knopp). All fp32.

The equations (fp32; the torch spelling of the split is ``kernels/reference.py``'s ``hc_split_sinkhorn``, of the
collapse / expand its ``hc_pre`` / ``hc_post``; on the GPU fused TileLang kernels with the same bits):

    v    = flatten(h)                      [hc*dim]      r = rsqrt(mean(v^2) + norm_eps)   (one statistic)
    m    = (fn @ v) * r                    [24]
    pre  = sigmoid(m[0:4] * scale[0] + base[0:4]) + hc_eps
    post = 2 * sigmoid(m[4:8] * scale[1] + base[4:8])
    C    = softmax_k(reshape(m[8:24] * scale[2] + base[8:24], 4 x 4)) + hc_eps      (C[j, k] = entry 8 + 4j + k)
    C    = C / (sum_j C[j, k] + hc_eps);  then (hc_sinkhorn_iters - 1) times: row-normalise, column-normalise
    comb = C
    hc_pre(h, pre)              = sum_j pre_j h_j                         [dim]
    hc_post(y, res, post, comb) = post_k y + sum_j comb[j, k] res_j       [hc, dim]   (k = output stream)

The one-sublayer delay of ``pre`` lives in the block (model.py ``block``): a sublayer's input is collapsed with
the ``pre`` the PREVIOUS sublayer computed.
"""
from __future__ import annotations

import torch

from . import kernels
from .config import Config
from .invariant import linear_rows


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, cfg: Config,
             impl: str | None = None):
    """h [b, s, hc, dim] -> (pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]), all fp32.

    ``m = (fn @ flatten(h)) * rsqrt(mean(flatten(h)^2) + eps)`` with fn [24, hc*dim] fp32.
    """
    v = h.flatten(-2).float()
    r = torch.rsqrt(v.square().mean(-1, keepdim=True) + cfg.norm_eps)
    m = linear_rows(v, fn.float()) * r
    return kernels.hc_split_sinkhorn(m, scale.float(), base.float(), cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                     cfg.hc_eps, impl=impl)


def hc_pre(h: torch.Tensor, pre: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """h [b, s, hc, dim], pre [b, s, hc] fp32. Collapse the streams: sum_j pre_j * h_j in fp32 (products rounded,
    summed in index order) -> [b, s, dim] in h's dtype (``kernels.hc_pre``: on the GPU one fused kernel with the
    same bits)."""
    return kernels.hc_pre(h, pre, impl=impl)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            impl: str | None = None) -> torch.Tensor:
    """Expand: out_k = post_k * y + sum_j comb[j, k] * res_j (fp32) -> [b, s, hc, dim] in y's dtype.

    y [b, s, dim] sublayer output, res [b, s, hc, dim] the sublayer's input streams (``kernels.hc_post``: on the
    GPU one fused kernel with the same bits, not the [b, s, hc, hc, dim] fp32 temporary of the torch spelling).
    """
    return kernels.hc_post(y, res, post, comb, impl=impl)
