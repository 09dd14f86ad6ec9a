"""KV compressor of the kv-source layers (SPEC §4) and the bookkeeping of compressed entries.

A compressed entry j pools ``ratio`` consecutive tokens of one sample (positions ``r*j .. r*j+r-1``
inside the sample). ratio 1: ``latent = RMSNorm(W_kv x)`` (bf16). ratio r > 1, in fp32:
``k_t = W_kv x_t``, ``g_t = W_gate x_t``; ``latent = RMSNorm(bf16(sum_t softmax_t(g)[c] * k_t[c]))``,
the softmax over the r tokens independently per channel. The output is RoPE-free: the indexer
consumes it first; the attention then rotates it (at the group's first position) and fp4-QDQs it.

Chunked use: tokens of a group still filling at the end of a chunk are kept as their fp32
projections in ``AttnCache.partial_kv/partial_score`` (row = position % ratio) and completed by the
next chunk, so any chunking gives the same entries as one pass.

Shape legend: b batch, s chunk length, n entries, r ratio, D head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Config
from .linear import linear
from .norm import rms_norm
from .state import BIG, Chunk

@dataclass
class NewEntries:
    """Entries completed in this chunk. latent [b, n, D] bf16 (RoPE-free); rope_pos, end, seg [b, n] int64
    (end = BIG marks padding in packed rows with fewer entries)."""
    latent: torch.Tensor
    rope_pos: torch.Tensor
    end: torch.Tensor
    seg: torch.Tensor


def compress(p: dict, x: torch.Tensor, *, cfg: Config, layer_id: int, chunk: Chunk, cache=None, mode: str = "reference"):
    """x [b, s, dim] (attention input) -> (NewEntries, new partial (kv, score) or (None, None)).

    p = params[...]["attn"]["compressor"] = {"wkv", "wgate" (ratio > 1), "norm"}.
    """
    r = cfg.compress_ratio(layer_id)
    b, s, _ = x.shape
    D = cfg.head_dim
    if r == 1:
        kv = linear(x, p["wkv"], mode=mode)
        return NewEntries(rms_norm(kv, p["norm"]["weight"], cfg.norm_eps), chunk.pos, chunk.pos_abs.expand(b, s),
                          chunk.seg_start), (None, None)

    xf = x.float()
    kv = linear(xf, {"weight": p["wkv"]["weight"].float()}, mode=mode)          # [b, s, D] fp32
    sc = linear(xf, {"weight": p["wgate"]["weight"].float()}, mode=mode)
    n_part = chunk.start % r if cache is not None else 0
    pos_abs = chunk.pos_abs.expand(b, s)
    pos, seg = chunk.pos, chunk.seg_start
    if n_part:
        kv = torch.cat([cache.partial_kv[:, :n_part], kv], 1)
        sc = torch.cat([cache.partial_score[:, :n_part], sc], 1)
        prev = torch.arange(chunk.start - n_part, chunk.start, device=x.device).expand(b, n_part)
        pos_abs = torch.cat([prev, pos_abs], 1)
        pos = torch.cat([prev, pos], 1)
        seg = torch.cat([torch.zeros_like(prev), seg], 1)
    m = kv.shape[1]
    ar = torch.arange(m, device=x.device).expand(b, m)
    is_end = (pos % r) == r - 1
    if chunk.packed:  # entries per row depend on where samples start
        n = int(is_end.sum(1).max()) if m else 0
    else:             # static count (keeps the function traceable under torch.func.vmap)
        n = (chunk.start + s) // r - (chunk.start - n_part) // r
    ends = torch.where(is_end, ar, BIG).sort(1).values[:, :n]                  # [b, n] index into the m tokens
    valid = ends < BIG
    ends_c = torch.where(valid, ends, r - 1)
    grp = ends_c[..., None] - (r - 1) + torch.arange(r, device=x.device)       # [b, n, r]
    bi = torch.arange(b, device=x.device)[:, None, None]
    k_g, s_g = kv[bi, grp], sc[bi, grp]                                        # [b, n, r, D]
    pooled = (k_g * torch.softmax(s_g, dim=2)).sum(2).to(x.dtype)
    latent = rms_norm(pooled, p["norm"]["weight"], cfg.norm_eps)
    bi2 = torch.arange(b, device=x.device)[:, None]
    entries = NewEntries(
        latent,
        rope_pos=pos[bi2, ends_c] - (r - 1),
        end=torch.where(valid, pos_abs[bi2, ends_c], BIG),
        seg=seg[bi2, ends_c],
    )
    # tokens after the last complete group: the partial group for the next chunk
    new_part = (None, None)
    if cache is not None:
        rem = (chunk.start + s) % r
        part_kv = torch.zeros(b, r, D, dtype=torch.float32, device=x.device)
        part_s = torch.full((b, r, D), float("-inf"), dtype=torch.float32, device=x.device)
        if rem:
            part_kv = torch.cat([kv[:, m - rem:], part_kv[:, rem:]], 1)
            part_s = torch.cat([sc[:, m - rem:], part_s[:, rem:]], 1)
        new_part = (part_kv, part_s)
    return entries, new_part
