"""Attention sublayer (SPEC §3): single-latent MQA over a sliding window plus selected compressed KV.

    qr = RMSNorm_q(W_qa x)                                  [b, s, q_lora_rank]
    q  = RoPE(W_qb qr).view(H, D)                           [b, s, H, D]   (RoPE on the last rd dims)
    kv = fp8_QDQ(RoPE(RMSNorm_kv(W_kv x)))                  [b, s, D]      one vector per token: K = V
    KV = [window rows ; compressed rows]
    o  = sparse_attn(q, KV, sink, [window slots ; top-k compressed + offset])   per-head sink logit
    out = W_ob( concat_g  W_oa[g] . RoPE^-1(o)_g )           grouped low-rank output, 8 groups

Compressed rows (layers with ratio > 0) come from the layer's kv source (SPEC §0.1): a Full layer runs
the compressor (§4) and the indexer (§5) itself and publishes KV, index keys and top-k in the
``SharedAttention`` value; a Reindex layer scores those keys with its own indexer inside the
candidate blocks; a Reuse layer takes KV and top-k as published.

Window rows: with no past (``chunk.start == 0``) the chunk's own kv; otherwise the ring's W rows in
position order (oldest first) followed by the chunk's kv. A query at position p sees positions
``max(sample start, p - W + 1) .. p``; its window slots list them ascending, -1 padding after.

Shape legend: b batch, s queries, H heads, D head_dim, W window, n compressed entries, k top-k.
"""
from __future__ import annotations

import torch

from . import kernels, quant
from .compressor import compress
from .config import Config
from .indexer import candidate_mask, entry_blocks, index_keys, index_scores, select_topk, visible_range
from .linear import dequantize, fp4_qdq, fp8_qdq, linear, qat_format
from .norm import rms_norm
from .rope import apply_rope, rope_angles
from .state import BIG, AttnCache, Chunk, SharedAttention


def project_qkv(p: dict, x: torch.Tensor, rot: torch.Tensor, *, cfg: Config, mode: str = "reference",
                impl: str | None = None, qdq: bool = True):
    """The single-latent projections (SPEC §3), x [b, s, dim] bf16, rot [b, s, rd/2] -> (qr [b, s, q_lora_rank]
    (normed; the indexer reads it too), q [b, s, H, D] (RoPE'd), kv [b, s, D] (normed, RoPE'd, fp8 QDQ unless
    ``qdq=False``)). Shared with the DSpark stages' attention (dspark.py)."""
    b, s, _ = x.shape
    eps, fq = cfg.norm_eps, qat_format(cfg)
    qr = rms_norm(linear(x, p["wq_a"], mode=mode, fake=fq, impl=impl), p["q_norm"]["weight"], eps)
    q = linear(qr, p["wq_b"], mode=mode, fake=fq, impl=impl).view(b, s, cfg.n_heads, cfg.head_dim)
    q = apply_rope(q, rot[:, :, None, :])
    kv = rms_norm(linear(x, p["wkv"], mode=mode, fake=fq, impl=impl), p["kv_norm"]["weight"], eps)
    return qr, q, fp8_qdq(apply_rope(kv, rot), qdq)


def window_index(chunk: Chunk, W: int, has_past: bool) -> torch.Tensor:
    """[b, s, W] rows of the window block that each query reads (-1 = none), valid slots first."""
    dev = chunk.pos_abs.device
    p = chunk.pos_abs[:, None]                                              # [s, 1]
    t = p - W + 1 + torch.arange(W, device=dev)                             # [s, W] key positions, ascending
    lo = chunk.seg_start[:, :, None].clamp_min(0)                           # [b, s, 1]
    valid = t[None] >= lo
    base = chunk.start - W if has_past else chunk.start
    rows = torch.where(valid, t[None] - base, BIG)
    rows = rows.sort(-1).values                                             # valid (ascending) first
    return torch.where(rows == BIG, -1, rows)


def roll_ring(ring: torch.Tensor | None, rows: torch.Tensor, chunk: Chunk, W: int, has_past: bool) -> torch.Tensor:
    """The window ring after this chunk: ring [b, W, D] or None (no past), rows [b, n_win, D] (the window block:
    the past ring in position order, if any, then this chunk's s rows) -> [b, W, D], slot j holding the newest
    position t <= end with t % W == j."""
    end = chunk.start + chunk.s - 1
    j = torch.arange(W, device=rows.device)
    t = end - ((end - j) % W)
    base = chunk.start - W if has_past else chunk.start
    src = (t - base).clamp(0, rows.shape[1] - 1)
    new = rows[:, src]
    if ring is None:
        ring = torch.zeros_like(new)
    return torch.where((t >= 0)[None, :, None], new, ring)


def attention(p: dict, x: torch.Tensor, *, cfg: Config, layer_id: int, chunk: Chunk, cache: AttnCache | None,
              shared: SharedAttention, mode: str = "reference", impl: str | None = None, qdq: bool = True,
              debug: dict | None = None, aux: dict | None = None):
    """x [b, s, dim] bf16 (normed) -> (out [b, s, dim], new cache or None, shared, topk).

    topk: this layer's selected compressed entries [b, s, index_topk] int64 (-1 = none; an index-source
    layer's own, a reuse layer's from its source), or None in a window-only layer.

    p = params["layers"][L]["attn"]; ``cache`` is the layer's AttnCache (None: no state, e.g. training).
    ``qdq=False`` skips the activation quantisation (fp8 KV, fp4 compressed KV and indexer q/k): the
    smooth model used for gradient checks, not the release's numerics. ``aux``: a dict that receives,
    for an index-source layer, what the indexer KL loss needs (``indexer_kl_terms``).
    """
    L = layer_id
    D, W = cfg.head_dim, cfg.window_size
    rot = rope_angles(cfg, L, chunk.pos)                                    # [b, s, rd/2]
    qr, q, kv = project_qkv(p, x, rot, cfg=cfg, mode=mode, impl=impl, qdq=qdq)

    has_past = cache is not None and chunk.start > 0
    if has_past:
        order = (chunk.start - W + torch.arange(W, device=x.device)) % W
        win_rows = torch.cat([cache.window_kv[:, order], kv], 1)
    else:
        win_rows = kv
    widx = window_index(chunk, W, has_past)
    n_win = win_rows.shape[1]
    new_cache = None
    if cache is not None:
        new_cache = AttnCache(roll_ring(cache.window_kv, win_rows, chunk, W, has_past))

    kv_all, idx = win_rows, widx
    topk = None
    role = cfg.attn_mode(L)         # SPEC §0.1: "window" | "full" (own compressor and indexer) | "reindex" (own
    src = cfg.kv_source(L)          # indexer over layer src's keys) | "reuse" (src's KV, index_source(L)'s top-k)
    if role != "window":
        if role == "full":
            shared, new_cache = _compress_and_publish(p, x, cfg=cfg, layer_id=L, chunk=chunk, cache=cache,
                                                      new_cache=new_cache, shared=shared, mode=mode, qdq=qdq)
        comp_kv, keys, visible = shared.kv[src], shared.index_k[src], shared.visible[src]
        if role in ("full", "reindex"):
            # level 2 (reindex layers after the candidate source): non-candidates are -inf inside the
            # scoring op. The KL student reads these scores at the selected slots only, which are all
            # candidates, so masking first changes neither its values there nor its gradient.
            cand = shared.candidates if cfg.uses_candidates(L) else None
            # the indexer's inputs detached (DeepSeek-V3.2's separate optimisation): its scores only select
            # slots (no gradient), so the indexer-KL student is their only gradient path, and it trains the
            # indexer alone; the main model learns from the LM loss only. Values are unchanged.
            score = index_scores(p["indexer"], x.detach(), qr.detach(), keys, visible, cfg=cfg, layer_id=L,
                                 pos=chunk.pos, mode=mode, qdq=qdq, cand=cand, impl=impl)
            if L == cfg.candidate_source_layer:
                nb = None if chunk.packed else -(-score.shape[-1] // cfg.candidate_block_size)
                blk = shared.blocks[src] if chunk.packed else cfg.candidate_block_size   # plain rows: j // size
                shared = shared.replace(candidates=candidate_mask(score, visible, blk, cfg=cfg, n_blocks=nb,
                                                                  impl=impl))
                if debug is not None:
                    debug["candidates"] = shared.candidates
            student = score
            topk = select_topk(score, cfg.index_topk, impl=impl)
            shared = shared.replace(topk={**shared.topk, L: topk})
            if debug is not None:
                debug["index_score"] = score
        else:                                                               # reuse
            topk = shared.topk[cfg.index_source(L)]
        kv_all = torch.cat([win_rows, comp_kv], 1)
        idx = torch.cat([widx, torch.where(topk >= 0, topk + n_win, -1)], -1)
        if debug is not None and role != "reuse":
            # in this call's index space: compressed slots start after the window block's n_win rows. In a
            # prefill that is the release's offset (W); in decode n_win = W + s (the ring, then the new rows),
            # where the release writes the new row into its ring first and offsets by W
            debug["topk_idxs"] = torch.where(topk >= 0, topk + n_win, -1)

    # the kernel sees a fixed width, window + index_topk (holes past the entries seen so far): its CPU row sums
    # round differently for another width, and a one-shot prefill sees more entries than a chunked one
    pad = W + cfg.index_topk - idx.shape[-1] if role != "window" else 0
    idx_k = torch.cat([idx, idx.new_full((*idx.shape[:-1], pad), -1)], -1) if pad > 0 else idx
    o = kernels.sparse_attn(q, kv_all, p["attn_sink"], idx_k.to(torch.int32), D ** -0.5, impl=impl)
    if aux is not None and topk is not None and L in cfg.index_source_layers:
        aux.update(indexer_kl_terms(q, kv_all, p["attn_sink"], idx, topk, student, D ** -0.5))
    if debug is not None:
        debug.update(sparse_idx=idx, sparse_kv=kv_all, sparse_out=o)
    return output_projection(p, o, rot, cfg=cfg, mode=mode, impl=impl), new_cache, shared, topk


def output_projection(p: dict, o: torch.Tensor, rot: torch.Tensor, *, cfg: Config, mode: str = "reference",
                      impl: str | None = None):
    """o [b, s, H, D] (sparse_attn output) -> [b, s, dim]: de-rotate the RoPE tail at the query positions
    (rot [b, s, rd/2]), then the grouped low-rank projection: heads in ``o_groups`` groups of consecutive
    heads, ``u_g = W_oa[g] o_g`` (bf16, wo_a always dequantised as the release's convert.py does),
    ``out = W_ob concat_g(u_g)``."""
    b, s = o.shape[:2]
    o = apply_rope(o, rot[:, :, None, :], inverse=True)
    G = cfg.o_groups
    wo_a = dequantize(p["wo_a"], o.dtype).view(G, cfg.o_lora_rank, -1)
    u = torch.einsum("bsgd,grd->bsgr", o.reshape(b, s, G, -1), wo_a)
    return linear(u.flatten(2), p["wo_b"], mode=mode, fake=qat_format(cfg), impl=impl)


def indexer_kl_terms(q, kv_all, sink, idx, topk, student, scale) -> dict:
    """Teacher and student of the lightning-indexer KL for one index-source layer.

    teacher [b, s, H, k]: the attention's own probability (sink included in the normaliser) on each
    selected compressed slot, per head, detached. student [b, s, k]: the indexer's scores at those
    slots, as ``index_scores`` returned them (with the candidate mask applied at level-2 layers: every
    selected slot is a candidate, so the mask changes neither the values there nor their gradient). It is
    the only path by which the indexer gets a gradient; its inputs are detached, so it reaches the indexer's
    own weights only.
    valid [b, s, k]: the slot exists.
    """
    k = topk.shape[-1]
    valid = topk >= 0
    with torch.no_grad():
        b = q.shape[0]
        bi = torch.arange(b, device=q.device)[:, None, None]
        kv_t = kv_all[bi, idx.clamp_min(0)].float()                              # [b, s, T, D]
        logits = torch.einsum("bshd,bstd->bsht", q.float(), kv_t) * scale
        logits = logits.masked_fill((idx < 0)[:, :, None, :], float("-inf"))
        sink_l = sink.float()[None, None, :, None].expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink_l], -1), -1)[..., :-1]
        teacher = probs[..., -k:]                                                # compressed slots last
    return {"teacher": teacher, "student": student.gather(-1, topk.clamp_min(0)), "valid": valid}


def _compress_and_publish(p, x, *, cfg, layer_id, chunk, cache, new_cache, shared, mode, qdq=True):
    """Full layer (SPEC §3-§5): compress this chunk's complete groups of x [b, s, dim] (``compress``: latent
    [b, n_new, D], their RoPE positions), their indexer keys (RoPE-free latent -> ``index_keys`` [b, n_new, Di]),
    the attention's compressed KV (RoPE, then fp4 QDQ with 16-element groups and E4M3 scales, SPEC §3); append
    both to the layer's history (cache, if any) and publish them in ``shared`` for the layers that reuse them
    (kv [b, n, D], index_k [b, n, Di], visible (lo, hi) [b, s] each, candidate blocks [b, n]).
    -> (shared, new_cache)."""
    L = layer_id
    r = cfg.compress_ratio(L)
    ent, (part_kv, part_s) = compress(p["compressor"], x, cfg=cfg, layer_id=L, chunk=chunk, cache=cache, mode=mode)
    keys_new = index_keys(p["indexer"], ent.latent.detach(), ent.rope_pos, cfg=cfg, layer_id=L, qdq=qdq)  # before RoPE
    kv_new = apply_rope(ent.latent, rope_angles(cfg, L, ent.rope_pos))
    kv_new = fp4_qdq(kv_new, 16, quant.FP8, qdq)                               # E4M3 scales, SPEC §3
    end, seg, group = ent.end, ent.seg, ent.rope_pos // r
    if cache is not None:
        n_prev = chunk.start // r
        n_new = kv_new.shape[1]
        if n_prev + n_new > cache.compress_kv.shape[1]:
            raise ValueError(f"layer {L}: compressed history full ({cache.compress_kv.shape[1]} rows)")
        hist_kv, hist_k = cache.compress_kv, cache.index_k
        if torch.is_grad_enabled() and any(t.requires_grad for t in (kv_new, keys_new, hist_kv, hist_k)):
            # differentiated through the state: a new history (one copy) rather than the in-place append below,
            # whose no_grad write would cut reverse-mode gradients from later chunks to the rows written here
            def put(buf, new):
                return torch.cat([buf[:, :n_prev], new.to(buf.dtype), buf[:, n_prev + n_new:]], 1)
            hist_kv, hist_k = put(hist_kv, kv_new), put(hist_k, keys_new)
        else:
            # append-only history: write the new rows past the old count (see state.py ownership rule)
            with torch.no_grad():
                hist_kv[:, n_prev:n_prev + n_new] = kv_new
                hist_k[:, n_prev:n_prev + n_new] = keys_new
        hist = torch.arange(n_prev, device=x.device)
        kv_new = torch.cat([hist_kv[:, :n_prev], kv_new], 1)
        keys_new = torch.cat([hist_k[:, :n_prev], keys_new], 1)
        end = torch.cat([(hist * r + r - 1).expand(x.shape[0], n_prev), end], 1)
        seg = torch.cat([torch.zeros_like(end[:, :n_prev]), seg], 1)
        group = torch.cat([hist.expand(x.shape[0], n_prev), group], 1)
        new_cache = AttnCache(new_cache.window_kv, hist_kv, hist_k, part_kv, part_s)
    visible = visible_range(end, chunk.pos_abs, chunk.seg_start)        # (lo, hi) [b, s] each
    shared = shared.replace(kv={**shared.kv, L: kv_new}, index_k={**shared.index_k, L: keys_new},
                            visible={**shared.visible, L: visible},
                            blocks={**shared.blocks, L: entry_blocks(group, seg, cfg=cfg)})
    return shared, new_cache
