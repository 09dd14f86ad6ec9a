"""Mixture of experts (SPEC §8): sqrt-softplus router, routed SwiGLU experts, one shared expert.

Shape legend: T tokens (b*s flattened), D model dim, E routed experts, K experts per token,
F expert intermediate dim.

Numerics (reference dtype flow): router logits in fp32 (``x_fp32 @ W_g^T / gate_temp``); the
selection adds the correction bias (``bias``, or ``bias_vl`` on image tokens) but the weights are
the unbiased scores, renormalised over the K chosen (when ``norm_topk_prob`` and K > 1) and scaled
by ``route_scale``. An expert computes ``w1 x`` and ``w3 x`` (bf16 GEMMs), then in fp32
``w * silu(min(gate, limit)) * clamp(up, -limit, limit)`` - the routing weight multiplies BEFORE the
down projection - cast to bf16 for ``w2``. Outputs accumulate in fp32 in ascending expert order,
the shared expert is added, and the sum is cast back to bf16.

Two dispatch formulations, equal in value:
- ``dispatch="sorted"``: tokens sorted by expert, one GEMM per expert that has tokens (what scales); with
  the release's fp4 experts in reference mode, one grouped GEMM over all of them per projection
  (``experts_grouped``, the same rows).
- ``dispatch="dense"``: every expert over every token, masked by the routing weights; no
  data-dependent shapes, so it works under ``torch.func.vmap`` (tiny configs only).

``p["experts"]`` is the released list of per-expert dicts, or the stacked form ``{"w1": {"weight": [E, ...]}, ..}``,
or that form split over an ``ep`` mesh dim (``sharding.py``): then this process runs its own experts on the slots
routed to them and the slot outputs are summed over ``ep`` before the per-token sum (the same order, the same bits).
"""

from __future__ import annotations

import torch

from .config import Config
from functional_dsv41 import kernels, quant
from . import invariant, sharding
from .linear import linear, qat_format


def route_scores(x_TD: torch.Tensor, gate: dict, *, cfg: Config, image_mask_T: torch.Tensor | None = None):
    """Router scores: x [T, D] -> (scores_TE fp32, the expert weights' source; choice_TE fp32, what top-k ranks:
    scores plus the balancing bias, ``bias_vl`` on image tokens)."""
    logits_TE = invariant.linear_rows(x_TD.float(), gate["weight"].float())
    if cfg.gate_temp != 1.0:
        logits_TE = logits_TE / cfg.gate_temp
    if cfg.score_func == "softmax":
        scores_TE = logits_TE.softmax(-1)
    elif cfg.score_func == "sigmoid":
        scores_TE = invariant.sigmoid(logits_TE)
    else:
        scores_TE = invariant.softplus(logits_TE).sqrt()
    bias_E = gate.get("bias")
    choice_TE = scores_TE
    if bias_E is not None:
        bias_TE = bias_E.float().expand_as(scores_TE)
        if image_mask_T is not None and "bias_vl" in gate:
            bias_TE = torch.where(image_mask_T[:, None], gate["bias_vl"].float(), bias_TE)
        choice_TE = scores_TE + bias_TE
    return scores_TE, choice_TE


def route(x_TD: torch.Tensor, gate: dict, *, cfg: Config, layer_id: int, image_mask_T: torch.Tensor | None = None):
    """Router: x [T, D] -> (weights_TK fp32, idx_TK int64) in torch.topk order (descending biased score)."""
    _, k = cfg.moe_experts(layer_id)
    scores_TE, choice_TE = route_scores(x_TD, gate, cfg=cfg, image_mask_T=image_mask_T)
    idx_TK = choice_TE.topk(k, dim=-1).indices
    w_TK = scores_TE.gather(-1, idx_TK)
    if cfg.norm_topk_prob and k > 1:
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
    return w_TK * cfg.route_scale, idx_TK


def _swiglu(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """fp32 [n, F] ``w * silu(min(gate, limit)) * clamp(up, -limit, limit)`` (w [n, 1] or None)."""
    lim = cfg.swiglu_limit
    if lim > 0:
        gate = gate.clamp(max=lim)
        up = up.clamp(-lim, lim)
    y = invariant.silu(gate) * up
    return y if w is None else w * y


def expert(x: torch.Tensor, p: dict, w: torch.Tensor | None, *, cfg: Config, mode: str, fake: str | None = None,
           impl: str | None = None):
    """One SwiGLU expert: x [n, D] bf16, routing weight w [n, 1] fp32 (None for the shared expert) -> [n, D]."""
    gate = linear(x, p["w1"], mode=mode, fake=fake, impl=impl).float()
    up = linear(x, p["w3"], mode=mode, fake=fake, impl=impl).float()
    y = _swiglu(gate, up, w, cfg)
    return linear(y.to(x.dtype), p["w2"], mode=mode, fake=fake, impl=impl)


def _grouped_ok(ps: list[dict], mode: str) -> bool:
    """The routed experts can run as grouped GEMMs: reference mode, fp4 weights, no biases (the release)."""
    return mode == "reference" and all(p[n]["weight"].dtype == quant.FP4X2 and "bias" not in p[n]
                                       for p in ps for n in ("w1", "w2", "w3"))


def experts_grouped(x_SD: torch.Tensor, ps: list[dict], w_S1: torch.Tensor, counts: list[int], *, cfg: Config,
                    impl: str | None = None) -> torch.Tensor:
    """The routed experts over expert-sorted rows, one grouped GEMM per projection: x [S, D] bf16 holds
    ``counts[g]`` consecutive rows for expert ``ps[g]`` (0 for an idle expert), routing weights w [S, 1] fp32
    -> [S, D] bf16. Row by row
    what ``expert`` computes (the activations are quantised per row, so quantising all rows at once changes
    nothing), in 2 act_quants and 3 ``fp4_gemm_grouped`` calls instead of 5 launches-heavy calls per expert."""
    def gemm(name, a, a_s):
        return kernels.fp4_gemm_grouped(a, a_s, [p[name]["weight"] for p in ps], [p[name]["scale"] for p in ps],
                                        counts, quant.E8M0, 32, impl=impl)
    xq, xs = kernels.act_quant(x_SD.to(torch.bfloat16), 32, "ue8m0", quant.E8M0, impl=impl)
    y = _swiglu(gemm("w1", xq, xs).float(), gemm("w3", xq, xs).float(), w_S1, cfg)
    yq, ys = kernels.act_quant(y.to(x_SD.dtype).to(torch.bfloat16), 32, "ue8m0", quant.E8M0, impl=impl)
    return gemm("w2", yq, ys)


_PROJ = ("w1", "w2", "w3")


def pack_experts(params, *, inplace: bool = False):
    """The tree with each MoE layer's fp4 routed experts re-homed so that, per projection and tensor (weight,
    scale), the E experts' tensors are equally spaced views of one [E, ...] buffer. Values, names, shapes and
    dtypes are unchanged (the checkpoint layout stays per expert); the TileLang grouped GEMM
    (``kernels.fp4_gemm_grouped``) then reads the experts in place instead of stacking a copy per call.
    Projections whose experts are not fp4 or differ in shape or device are left as they are.
    ``inplace=False``: a new tree (the input is unchanged; both hold the experts until the input is dropped);
    ``inplace=True``: the input's expert dicts are updated, so each projection's old tensors are freed as soon
    as it is packed (``init_params`` / ``load_params``, which own their trees)."""
    def pack_list(experts):
        if not experts or not all(isinstance(e, dict) and all(isinstance(e.get(n), dict) for n in _PROJ)
                                  for e in experts):
            return experts
        out = experts if inplace else [{**e, **{n: dict(e[n]) for n in _PROJ}} for e in experts]
        for n in _PROJ:
            if not isinstance(experts[0][n].get("weight"), torch.Tensor) or experts[0][n]["weight"].dtype != quant.FP4X2:
                continue
            for leaf in list(experts[0][n]):
                ts = [e[n].get(leaf) for e in out]
                t0 = ts[0]
                if not isinstance(t0, torch.Tensor) or not all(
                        isinstance(t, torch.Tensor) and t.shape == t0.shape and t.dtype == t0.dtype
                        and t.device == t0.device for t in ts):
                    continue
                buf = torch.stack(ts)
                del ts, t0
                for i, e in enumerate(out):
                    e[n][leaf] = buf[i]
        return out

    def walk(node):
        if isinstance(node, dict):
            new = {k: (pack_list(v) if k == "experts" and isinstance(v, list) else walk(v)) for k, v in node.items()}
            if inplace:
                node.update(new)
                return node
            return new
        if isinstance(node, list):
            new = [walk(v) for v in node]
            if inplace:
                node[:] = new
                return node
            return new
        return node
    return walk(params)


def moe(p: dict, x: torch.Tensor, *, cfg: Config, layer_id: int, image_mask: torch.Tensor | None = None,
        mode: str = "reference", dispatch: str = "sorted", return_routing: bool = False, impl: str | None = None):
    """The FFN sublayer: x [b, s, D] bf16 -> [b, s, D] bf16 (and optionally (weights, idx) [b*s, K])."""
    shape = x.shape
    x_TD = x.reshape(-1, shape[-1])
    im_T = image_mask.reshape(-1) if image_mask is not None else None
    w_TK, idx_TK = route(x_TD, p["gate"], cfg=cfg, layer_id=layer_id, image_mask_T=im_T)
    kw = dict(cfg=cfg, mode=mode, fake=qat_format(cfg, "experts"), impl=impl)
    if dispatch == "sorted":
        y_TD = _routed_sorted(x_TD, w_TK, idx_TK, p["experts"], **kw)
    elif dispatch == "dense":
        y_TD = _routed_dense(x_TD, w_TK, idx_TK, p["experts"], **kw)
    else:
        raise ValueError(f"moe: dispatch must be 'sorted' or 'dense', got {dispatch!r}")
    if "shared_experts" in p:
        y_TD = y_TD + expert(x_TD, p["shared_experts"], None, cfg=cfg, mode=mode, fake=qat_format(cfg),
                             impl=impl).float()
    y = y_TD.to(x.dtype).reshape(shape)
    return (y, (w_TK, idx_TK)) if return_routing else y


def _routed_sorted(x_TD, w_TK, idx_TK, node, *, cfg: Config, mode: str, fake, impl) -> torch.Tensor:
    """The routed experts' sum, fp32 [T, D]: token slots grouped by expert, one GEMM per active expert (or one
    grouped GEMM per projection, ``experts_grouped``), then each token's K outputs added in ascending expert
    order. ``node`` is ``p["experts"]``; split over "ep" (``sharding.py``), this rank runs its own experts on the
    slots routed to them and the slot outputs are summed over "ep" before the per-token sum (the same bits)."""
    experts, first, n_exp = sharding.local_experts(node)      # (all of them, from 0, unless split over "ep")
    xe_TD, we_TK = sharding.expert_inputs((x_TD, w_TK), node)  # (x_TD, w_TK) unless split over "ep"
    K = idx_TK.shape[1]
    flat_e = idx_TK.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=n_exp).tolist()
    lo = sum(counts[:first])                     # the sorted slots [lo, hi) go to this rank's experts
    counts = counts[first:first + len(experts)]
    hi = lo + sum(counts)
    tok = order[lo:hi] // K
    wts = we_TK.reshape(-1)[order[lo:hi]]
    outs = []
    if hi > lo and _grouped_ok(experts, mode):
        outs = [experts_grouped(xe_TD[tok], experts, wts[:, None], counts, cfg=cfg, impl=impl).float()]
    elif hi > lo:
        start = 0
        for e, n in enumerate(counts):
            if n:
                outs.append(expert(xe_TD[tok[start:start + n]], experts[e], wts[start:start + n, None],
                                   cfg=cfg, mode=mode, fake=fake, impl=impl).float())
                start += n
    # back to [T, K] slots (another rank's slots zero here, summed over "ep"), each token's K outputs added in
    # ascending expert order
    # (no slot here: a 0-row value still tied to xe_TD / we_TK, so that their backward - a sum over "ep" -
    # runs on every rank, as a collective must, and to the experts, whose gradients are then 0, not None)
    mine = torch.cat(outs) if outs else xe_TD[:0].float() * we_TK.reshape(-1)[:0, None] + sharding.no_slots(node)
    slot_out = (mine.new_empty if hi - lo == flat_e.shape[0] else mine.new_zeros)(flat_e.shape[0], x_TD.shape[1])
    slot_out = sharding.sum_experts(slot_out.index_copy(0, order[lo:hi], mine), node)
    slot_out = slot_out.view(-1, K, x_TD.shape[1])
    slot_out = slot_out.gather(1, idx_TK.argsort(-1)[..., None].expand_as(slot_out))
    y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for k in range(K):
        y_TD = y_TD + slot_out[:, k]
    return y_TD


def _routed_dense(x_TD, w_TK, idx_TK, node, *, cfg: Config, mode: str, fake, impl) -> torch.Tensor:
    """The routed experts' sum, fp32 [T, D]: every expert over every token, masked by the routing weights (no
    data-dependent shapes: works under ``torch.func.vmap``; tiny configs only). Split over "ep", the partial sums
    are summed over "ep" (not the same bits as one process)."""
    experts, first, n_exp = sharding.local_experts(node)
    xe_TD, we_TK = sharding.expert_inputs((x_TD, w_TK), node)
    dense_w_TE = torch.zeros(x_TD.shape[0], n_exp, dtype=torch.float32,
                             device=x_TD.device).scatter(-1, idx_TK, we_TK)
    y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for i, ex in enumerate(experts):
        e = first + i
        out = expert(xe_TD, ex, dense_w_TE[:, e:e + 1], cfg=cfg, mode=mode, fake=fake, impl=impl)
        y_TD = y_TD + out.float() * (dense_w_TE[:, e:e + 1] != 0)
    return sharding.sum_experts(y_TD, node)
