"""Functional AdamW over flat parameter dicts ``{path: tensor}``, global-norm clipping, LR schedule.

Everything here returns new tensors and never writes into its inputs, so a train state is a plain
value: ``params, opt_state = adamw_update(grads, opt_state, params, lr=..., cfg=...)``.

AdamW follows ``torch.optim.AdamW`` (single-tensor path) op for op, so with fp32 params the two agree
bit for bit (tests/test_train_optim.py): decoupled decay ``p *= 1 - lr*wd`` first, then
``m = lerp(m, g, 1-b1)``, ``v = b2 v + (1-b2) g²``, ``p -= lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps)``.
Moments are fp32 whatever the parameter dtype; a bf16 parameter is updated in fp32 and rounded back
(prefer fp32 master weights: a bf16 parameter loses small updates).

Weight decay skips norms, biases, hyper-connection bases/scales, attention sinks, the Engram
``q_weight``/``k_weight`` and every tensor of fewer than 2 dims (``decays``). The Engram pair is
``[hc_mult, dim]`` but no projection: per-channel gains on the RMS-normalised stream and key of the gate
(SPEC §6.5), initialised to ones like norm weights: decay would pull them from 1 towards 0, i.e. flatten
the gate's logit, rather than regularise a projection.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from functional_dsv41 import sharding

_NO_DECAY_KEYS = ("norm", "bias", "hc_attn_base", "hc_ffn_base", "hc_attn_scale", "hc_ffn_scale",
                  "hc_head_base", "hc_head_scale", "attn_sink")
_NO_DECAY_ENGRAM = ("q_weight", "k_weight")   # leaf names under an ``engram`` module (module docstring)


@dataclass(frozen=True)
class AdamWConfig:
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


def decays(path: str, t: torch.Tensor) -> bool:
    """Whether weight decay applies to the parameter at ``path`` (module docstring)."""
    if t.ndim < 2:
        return False
    parts = path.split(".")
    if "engram" in parts[:-1] and parts[-1] in _NO_DECAY_ENGRAM:
        return False
    return not any(k in p for p in parts for k in _NO_DECAY_KEYS)


def adamw_init(params: dict[str, torch.Tensor]) -> dict:
    """Optimizer state for ``params``: step count and fp32 first/second moments per path."""
    return {"count": 0,
            "mu": {k: torch.zeros_like(v, dtype=torch.float32) for k, v in params.items()},
            "nu": {k: torch.zeros_like(v, dtype=torch.float32) for k, v in params.items()}}


def adamw_update(grads: dict[str, torch.Tensor], state: dict, params: dict[str, torch.Tensor], *,
                 lr: float, cfg: AdamWConfig = AdamWConfig()) -> tuple[dict, dict]:
    """One AdamW step. Returns ``(new_params, new_state)``; inputs are not modified."""
    if set(grads) != set(params):
        missing, extra = sorted(set(params) - set(grads)), sorted(set(grads) - set(params))
        raise KeyError(f"adamw_update: grads/params keys differ (missing {missing[:3]}, extra {extra[:3]})")
    if not (math.isfinite(lr) and math.isfinite(cfg.weight_decay)):
        # an inf lr / decay turns every parameter into NaN or inf in one step, which nothing after would catch
        raise ValueError(f"adamw_update: lr and weight_decay must be finite, got lr={lr}, "
                         f"weight_decay={cfg.weight_decay}")
    t = state["count"] + 1
    bc1 = 1 - cfg.b1 ** t
    bc2_sqrt = (1 - cfg.b2 ** t) ** 0.5
    step_size = lr / bc1
    new_p, new_mu, new_nu = {}, {}, {}
    for k, p in params.items():
        g = grads[k].to(torch.float32)
        p32 = p.to(torch.float32)
        if cfg.weight_decay > 0 and decays(k, p):
            p32 = p32.mul(1 - lr * cfg.weight_decay)
        mu = state["mu"][k].lerp(g, 1 - cfg.b1)
        nu = state["nu"][k].mul(cfg.b2).addcmul(g, g, value=1 - cfg.b2)
        denom = (nu.sqrt() / bc2_sqrt).add(cfg.eps)
        new_p[k] = p32.addcdiv(mu, denom, value=-step_size).to(p.dtype)
        new_mu[k], new_nu[k] = mu, nu
    return new_p, {"count": t, "mu": new_mu, "nu": new_nu}


def global_norm(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """sqrt(Σ ||g||²) in fp32 over all leaves (the norm ``clip_grad_norm_`` computes)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    plain = [g for g in grads.values() if not sharding.is_sharded(g)]
    parts = [torch.linalg.vector_norm(g.float()) for g in plain] + _sharded_norms(
        [g for g in grads.values() if sharding.is_sharded(g)])
    return torch.linalg.vector_norm(torch.stack(parts))


def _sharded_norms(shards: list) -> list[torch.Tensor]:
    """The norms of a sharded tree's DTensor gradients (functional_dsv41.sharding) as plain tensors: one per
    (mesh, split dim), each rank's local sum of squares summed by one collective per group, in an order every
    rank shares (not one collective per leaf in dict order, which ranks would have to iterate alike)."""
    groups: dict = {}
    for g in shards:
        key = (id(g.device_mesh), tuple(map(str, g.placements)))
        local = torch.linalg.vector_norm(g.to_local().float()).square()
        groups.setdefault(key, [g, []])[1].append(local)
    out = []
    for key in sorted(groups, key=lambda k: k[1]):      # placements' text: the same on every rank
        like, sq = groups[key]
        out.append(sharding.sum_over_split(torch.stack(sq).sum(), like).sqrt())
    return out


def clip_by_global_norm(grads: dict[str, torch.Tensor], max_norm: float
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Scale grads so their global norm is at most ``max_norm`` (<= 0: no clipping).

    Same coefficient as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + 1e-6))``.
    Returns ``(clipped, norm_before)``.
    """
    if math.isnan(max_norm):   # NaN <= 0 is False: every gradient would be scaled by NaN
        raise ValueError("clip_by_global_norm: max_norm is NaN (<= 0 turns clipping off, inf never clips)")
    norm = global_norm(grads)
    if max_norm <= 0:
        return grads, norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    def scaled(g):              # (a sharded tree's DTensor gradient takes the coefficient replicated)
        return (g * (sharding.replicated(coef, g) if sharding.is_sharded(g) else coef)).to(g.dtype)
    return {k: scaled(g) for k, g in grads.items()}, norm


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Learning rate of update number ``step`` (0-based): linear warmup, then cosine to ``min_ratio·peak``.

    Warmup: ``peak·(step+1)/warmup`` for step < warmup (so the first update is not a zero step).
    Cosine: from ``peak`` at step = warmup down to ``peak·min_ratio`` at step = total - 1; constant after.
    A run with ``total - 1 <= warmup`` ends in warmup or at its peak (step ``warmup``) and never decays: the
    cosine then spans the one step after ``warmup``.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - 1 - warmup, 1)
    prog = min((step - warmup) / span, 1.0)
    lo = peak * min_ratio
    return lo + 0.5 * (peak - lo) * (1 + math.cos(math.pi * prog))
