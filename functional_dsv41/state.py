"""State carriers (DESIGN convention 4): frozen dataclasses registered as pytree nodes.

- ``AttnCache`` (one per layer that attends): the sliding-window ring, and for kv-source layers the
  append-only compressed history, its index keys and the partial compression group still filling.
- ``SharedAttention``: what source layers hand to the layers that reuse them *within one forward*
  (compressed KV, index keys, top-k, candidate mask), keyed by the source layer id.
- ``DecodeState``: every layer's ``AttnCache``, the n-gram tail, the DSpark draft windows and the
  position; the one value ``forward`` takes and returns.

Ownership rule for the append-only histories (``compress_kv``, ``index_k``): a forward writes its new
entries into the preallocated buffer at rows ``>= n_compressed`` of the state it was given and returns
a state with a larger count; rows below the old count are never touched, so the old state stays a
valid (shorter) state. Rolling back (speculative decoding) is taking an older state: histories are
cut back by length, never cloned. Bounded pieces (window ring, partial group, n-gram tail) are new
tensors in every returned state. Two futures may not be grown from one state at the same time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .config import Config
from .pytree import register_carrier


@register_carrier
@dataclass(frozen=True)
class AttnCache:
    """Per-layer inference cache.

    window_kv     [b, window, head_dim] bf16: ring buffer, row = position % window
    compress_kv   [b, max_seq_len // ratio, head_dim] bf16 (kv-source layers): RoPE'd, fp4-QDQ'd latents
    index_k       [b, max_seq_len // ratio, index_head_dim] bf16 (kv-source layers): indexer keys
    partial_kv    [b, ratio, head_dim] fp32 (ratio > 1 sources): compressor projections of the group
                  still filling, row = position % ratio (zeros where unused)
    partial_score [b, ratio, head_dim] fp32: their gate scores (-inf where unused)
    """
    window_kv: torch.Tensor
    compress_kv: Optional[torch.Tensor] = None
    index_k: Optional[torch.Tensor] = None
    partial_kv: Optional[torch.Tensor] = None
    partial_score: Optional[torch.Tensor] = None


@register_carrier
@dataclass(frozen=True)
class SharedAttention:
    """Within-forward hand-over from source layers (SPEC §0.1), keyed by source layer id.

    kv[L]         [b, n_compressed, head_dim]: all compressed KV rows visible to this chunk
    index_k[L]    [b, n_compressed, index_head_dim]
    topk[L]       [b, s, k] int64 compressed-entry indices (no window offset), -1 = none
    visible[L]    (lo, hi) [b, s] int64 each: the query sees entries lo <= j < hi (complete, own sample)
    blocks[L]     [b, n_compressed] int64: candidate block of each entry (never spanning two samples)
    candidates    [b, s, n_compressed] bool, published by the candidate source layer
    """
    kv: dict = dataclasses.field(default_factory=dict)
    index_k: dict = dataclasses.field(default_factory=dict)
    topk: dict = dataclasses.field(default_factory=dict)
    visible: dict = dataclasses.field(default_factory=dict)
    blocks: dict = dataclasses.field(default_factory=dict)
    candidates: Optional[torch.Tensor] = None

    def replace(self, **kw) -> "SharedAttention":
        return dataclasses.replace(self, **kw)


@register_carrier
@dataclass(frozen=True)
class DecodeState:
    """Everything a chunk needs from the past. ``pos`` = tokens already processed (same for all rows).

    layers[L]   AttnCache of backbone layer L
    dspark[s]   AttnCache (window only) of DSpark stage s: the main-model KV ring (SPEC §7)
    ngram       the Engram n-gram tail (engram.NgramCache) or None
    """
    pos: int
    batch_size: int
    max_seq_len: int
    layers: tuple
    dspark: tuple = ()
    ngram: object = None
    config_id: str = ""

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)


def config_id(cfg: Config) -> str:
    """A short fingerprint of the config a state was built for (refuse a state from another model)."""
    import hashlib
    import json
    return hashlib.sha1(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def init_state(cfg: Config, batch_size: int, max_seq_len: Optional[int] = None, *, device=None) -> DecodeState:
    """An empty state for ``batch_size`` rows of up to ``max_seq_len`` tokens (default cfg.max_seq_len)."""
    max_seq_len = max_seq_len or cfg.max_seq_len
    if batch_size < 1 or max_seq_len < 1:
        raise ValueError(f"init_state: batch_size and max_seq_len must be >= 1, got {batch_size}, {max_seq_len}")
    b, W, D = batch_size, cfg.window_size, cfg.head_dim
    bf16 = torch.bfloat16

    def cache(L: int) -> AttnCache:
        ring = torch.zeros(b, W, D, dtype=bf16, device=device)
        if L not in cfg.kv_source_layers:
            return AttnCache(ring)
        r = cfg.compress_ratio(L)
        n = max_seq_len // r
        part_kv = part_s = None
        if r > 1:
            part_kv = torch.zeros(b, r, D, dtype=torch.float32, device=device)
            part_s = torch.full((b, r, D), float("-inf"), dtype=torch.float32, device=device)
        return AttnCache(ring, torch.zeros(b, n, D, dtype=bf16, device=device),
                         torch.zeros(b, n, cfg.index_head_dim, dtype=bf16, device=device), part_kv, part_s)

    ngram = None
    if cfg.engram_layer_ids:
        from . import engram
        ngram = engram.init_ngram_cache(cfg, b)
    return DecodeState(
        pos=0, batch_size=b, max_seq_len=max_seq_len,
        layers=tuple(cache(L) for L in cfg.layer_ids),
        dspark=tuple(AttnCache(torch.zeros(b, W, D, dtype=bf16, device=device)) for _ in cfg.dspark_layer_ids),
        ngram=ngram, config_id=config_id(cfg),
    )


def state_bytes(state: DecodeState) -> int:
    """Bytes held by a state's tensors."""
    import torch.utils._pytree as tp
    return sum(t.numel() * t.element_size() for t in tp.tree_leaves(state) if isinstance(t, torch.Tensor))
