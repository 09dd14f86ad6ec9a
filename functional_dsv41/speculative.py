"""Speculative decoding pieces: verification of a drafted block and rollback of the rejected tail.

Verification (one main-model forward over ``[last, d_1 .. d_B]``): logits row i is the main model's
distribution p_i of the token after ``d_i`` (``d_0 = last``). Greedy: ``d_{i+1}`` is accepted while it
equals ``argmax p_i``. Sampling (Leviathan et al. 2023, Chen et al. 2023): ``d_{i+1} ~ q_i`` (the draft's
distribution) is accepted with probability ``min(1, p_i(d)/q_i(d))``; at the first rejection the
replacement is drawn from ``norm(max(p_i - q_i, 0))``; if all B are accepted a bonus token is drawn
from ``p_B``. Every emitted token is then distributed exactly as plain sampling from p.

Rollback (state.py ownership rule). After the verify forward the state has consumed all B+1 tokens;
only m <= B+1 of them are accepted. ``rollback`` builds the state "before + the m accepted tokens":

- append-only histories (``compress_kv``, ``index_k``) are shared buffers: taking ``pos`` back cuts
  them by length (rows past the new count are ignored and rewritten later), never cloned;
- the window ring of every layer: slots of the rejected positions get back the rows they held
  BEFORE the verify forward (those are exactly the positions the shorter window still needs) -
  valid when the verified chunk is at most ``window_size`` long;
- the n-gram tail: the last ``max_ngram-1`` compressed ids of (old tail + accepted tokens);
- the partial compression group of ratio > 1 sources: empty when the new position is a multiple of
  the ratio (the group closed inside the accepted part). Otherwise the group's per-token fp32
  projections of accepted positions are not kept by the forward, so the accepted tokens are re-run
  from the snapshot (``forward(before, accepted)``): exact, one extra forward over m tokens.

DSpark rings are rebuilt by the caller from the verify forward's ``main_hidden`` (causality makes
the accepted positions' hidden states exact whatever was rejected after them): the rolled-back state
keeps ``before``'s rings and ``dspark_pos``, so ``dspark_prefill(params, v.main_hidden[:, :m],
state=rolled_back)`` extends them (and ``dspark_draft`` refuses rings that were not refreshed).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .config import Config, require_config
from .state import AttnCache, DecodeState, config_mismatch


def fast_rollback_ok(before: DecodeState, after: DecodeState, m: int, cfg: Config) -> bool:
    """True when ``rollback`` can rebuild the state without re-running the accepted tokens."""
    new_pos = before.pos + m
    if after.pos - before.pos > cfg.window_size:
        return False
    return all(new_pos % cfg.compress_ratio(L) == 0 for L in cfg.kv_source_layers if cfg.compress_ratio(L) > 1)


def rollback(params: dict, before: DecodeState, after: DecodeState, tokens: torch.Tensor, *, cfg: Config,
             forward_kw: Optional[dict] = None) -> tuple[DecodeState, bool]:
    """The state of ``before`` having consumed ``tokens`` [b, m] (the accepted prefix of the chunk that
    took ``before`` to ``after``). Returns ``(state, reran)``; ``reran`` = an extra forward was needed.
    DSpark rings are taken from ``before`` (the caller refreshes them).
    Raises ValueError (host-side checks, no device work) when the states or the tokens do not belong
    together: another config, other batch sizes, ``after`` not ahead of ``before``."""
    from .model import forward
    _check_rollback(before, after, tokens, cfg)
    m = tokens.shape[1]
    if not 0 < m <= after.pos - before.pos:
        raise ValueError(f"rollback: {m} accepted tokens for a chunk of {after.pos - before.pos}")
    if m == after.pos - before.pos:
        return after, False
    if not fast_rollback_ok(before, after, m, cfg):
        out = forward(params, {"input_ids": tokens}, cfg=cfg, state=before, validate=False, **(forward_kw or {}))
        return out.state, True
    W = cfg.window_size
    dev = tokens.device
    new_pos = before.pos + m
    rejected = torch.arange(new_pos, after.pos, device=dev) % W             # slots of the rejected positions
    layers = []
    for L, (c0, c1) in enumerate(zip(before.layers, after.layers)):
        ring = c1.window_kv.index_copy(1, rejected, c0.window_kv.index_select(1, rejected))
        part_kv, part_s = c1.partial_kv, c1.partial_score
        if part_kv is not None:                                              # aligned: the group is empty
            part_kv = torch.zeros_like(part_kv)
            part_s = torch.full_like(part_s, float("-inf"))
        layers.append(AttnCache(ring, c1.compress_kv, c1.index_k, part_kv, part_s))
    ngram = after.ngram
    if before.ngram is not None:
        from .engram import NgramCache
        tmap = params["engram_token_map"].to(dev, torch.int64)
        G = before.ngram.tail.shape[1]
        ngram = NgramCache(torch.cat([before.ngram.tail, tmap[tokens.long()]], 1)[:, -G:])
    return dataclasses.replace(before, pos=new_pos, layers=tuple(layers), ngram=ngram), False


def _check_rollback(before, after, tokens, cfg: Config) -> None:
    require_config(cfg, "rollback")
    for name, st in (("before", before), ("after", after)):
        if not isinstance(st, DecodeState):
            raise TypeError(f"rollback: {name} must be a DecodeState, got {type(st).__name__}")
        why = config_mismatch(st.config_id, cfg, what=f"the state `{name}`")
        if why:
            raise ValueError(f"rollback: {why}")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        got = f"a tensor {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"rollback: tokens must be the accepted tokens [b, m], got {got}")
    if after.batch_size != before.batch_size:
        raise ValueError(f"rollback: `before` holds {before.batch_size} rows but `after` {after.batch_size}; "
                         f"`after` must be the state a forward from `before` returned")
    if tokens.shape[0] != before.batch_size:
        raise ValueError(f"rollback: tokens have {tokens.shape[0]} rows but the states hold {before.batch_size}")
    if after.pos <= before.pos:
        raise ValueError(f"rollback: `after` (position {after.pos}) is not ahead of `before` (position "
                         f"{before.pos}); `after` must be the state a forward from `before` returned")


def accept_greedy(main_logits: torch.Tensor, block: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """main_logits [b, B+1, V]; block [b, B] the tokens after ``last``; forced [b, B] bool (prompt tokens,
    accepted by fiat) -> ok [b, B] bool: block token i agrees with the main model's argmax (or is forced)."""
    return forced | (block == main_logits[:, :-1].argmax(-1))


def accept_sampling(p: torch.Tensor, q: torch.Tensor, block: torch.Tensor, forced: torch.Tensor,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Rejection test. p [b, B, V] main distributions, q [b, B, V] the draft distributions the block was
    drawn from, block [b, B], forced [b, B] -> ok [b, B] bool: u < p(d)/q(d) with u ~ U(0, 1)."""
    pd = p.gather(-1, block[..., None])[..., 0]
    qd = q.gather(-1, block[..., None])[..., 0]
    u = torch.rand(pd.shape, generator=generator, device=p.device)
    return forced | (u * qd < pd)


def leading(ok: torch.Tensor) -> torch.Tensor:
    """ok [b, B] bool -> [b] int64: the number of leading True."""
    return ok.long().cumprod(-1).sum(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) [..., V]; where p == q (nothing left) p itself."""
    r = (p - q).clamp_min(0)
    z = r.sum(-1, keepdim=True)
    return torch.where(z > 0, r / z.clamp_min(1e-30), p)
