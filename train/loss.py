"""Training losses as a named dict of parts; ``total = Σ coef[name] · part[name]`` over the parts that are on.

Parts (``LOSS_NAMES``):
  - ``ce``: next-token cross-entropy, mean over valid targets (``labels != IGNORE``; data.make_labels
    never lets a target cross a packed-sample boundary).
  - ``draft``: DSpark draft cross-entropy (optional): ``fd.dspark_forward`` (stateless, teacher-forced
    draft over the packed rows, fed the main forward's ``main_hidden``) gives, for every anchor
    position p, the draft logits of the block after p and their targets (tokens p+2.. of the same
    sample, -1 past it); mean CE over the valid, non-padding targets (needs ``pad_id``).
    ``draft_anchor_stride`` > 1 drafts after every k-th position only (the draft costs anchors x block queries).
  - ``indexer_kl``: lightning-indexer distillation (optional, off by default): per index-source
    layer, KL(teacher ‖ softmax(student)) over the selected compressed slots, where the teacher is
    the attention's own probability mass on each selected slot (detached; summed over heads if it has
    a head axis, renormalised over the slots) and the student the indexer's scores at those slots
    before the candidate mask. The indexer's inputs are detached in the forward (DeepSeek-V3.2), so this
    part trains the indexer's weights only and the other parts never reach them. Mean over query tokens
    that have at least one valid slot and are not padding (needs ``pad_id``), then over layers. Needs
    ``forward(..., aux=True)`` to return ``out.aux["indexer"]``.

A coefficient ``<= 0`` switches its part OFF: it is not computed at all (no forward extras, no graph),
not a zero-weighted term. ``compute_losses`` raises if every part is off.
"""
from __future__ import annotations

import inspect
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from .data import IGNORE

LOSS_NAMES = ("ce", "draft", "indexer_kl")
DEFAULT_COEFS = {"ce": 1.0, "draft": 0.0, "indexer_kl": 0.0}


def active(coefs: Mapping[str, float]) -> list[str]:
    """Names of the parts that are on (coefficient > 0), in LOSS_NAMES order."""
    unknown = sorted(set(coefs) - set(LOSS_NAMES))
    if unknown:
        raise KeyError(f"unknown loss part(s) {unknown}; known: {list(LOSS_NAMES)}")
    return [n for n in LOSS_NAMES if float(coefs.get(n, 0.0)) > 0]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over targets != IGNORE. logits [..., V] (fp32 upcast), labels [...] int64 -> scalar fp32."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    lab = labels.reshape(-1)
    n = (lab != IGNORE).sum()
    if int(n) == 0:
        raise ValueError("cross_entropy: the batch has no valid targets")
    return F.cross_entropy(flat, lab, ignore_index=IGNORE, reduction="sum") / n


def per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CE per position, shaped like ``labels`` (0 where there is no target): for tests and evaluation.

    logits ``[..., V]`` with any number of leading dims (``[b, s, V]``, the draft's ``[b, n, B, V]``), labels
    ``[...]``: the class axis is the last one (moved to dim 1, where ``F.cross_entropy`` wants it)."""
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"per_token_ce: logits {tuple(logits.shape)} must be labels' shape "
                         f"{tuple(labels.shape)} plus a vocabulary axis")
    lab = labels.clamp_min(0)
    ce = F.cross_entropy(logits.float().movedim(-1, 1), lab, reduction="none")
    return torch.where(labels != IGNORE, ce, torch.zeros_like(ce))


def indexer_kl(aux_indexer: Mapping, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """KL(teacher ‖ softmax(student)) averaged over layers (module docstring): the layers with at least one
    counted query token (a layer without any adds nothing and does not dilute the mean; no host sync).

    ``aux_indexer``: {layer: {"teacher": [b, s, k] or [b, s, h, k], "student": [b, s, k], optional
    "valid": [b, s, k] bool}}. Slots with a non-finite student score or ``valid == False`` are excluded.
    ``token_mask`` [b, s] bool: query tokens to average over (e.g. not padding).
    """
    if not aux_indexer:
        raise ValueError("indexer_kl: the forward returned no indexer aux (no index-source layers?)")
    per_layer, counted = [], []
    for layer, d in sorted(aux_indexer.items()):
        t, st = d["teacher"].detach().float(), d["student"].float()
        if t.dim() == st.dim() + 1:
            t = t.sum(-2)                                  # sum over heads
        valid = torch.isfinite(st) & torch.isfinite(t)
        if d.get("valid") is not None:
            valid &= d["valid"]
        t = torch.where(valid, t.clamp_min(0), torch.zeros_like(t))
        tsum = t.sum(-1, keepdim=True)
        p = t / tsum.clamp_min(1e-30)
        logq = torch.log_softmax(torch.where(valid, st, torch.full_like(st, float("-inf"))), -1)
        logq = torch.where(valid, logq, torch.zeros_like(logq))
        kl_tok = (p * (torch.log(p.clamp_min(1e-30)) - logq)).sum(-1)          # [b, s]
        rows = valid.any(-1) & (tsum.squeeze(-1) > 0)
        if token_mask is not None:
            rows &= token_mask
        n = rows.sum()
        per_layer.append(torch.where(rows, kl_tok, torch.zeros_like(kl_tok)).sum() / n.clamp_min(1))
        counted.append(n > 0)
    return torch.stack(per_layer).sum() / torch.stack(counted).sum().clamp_min(1)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        ps = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in ps or any(p.kind == p.VAR_KEYWORD for p in ps.values())


def check_pad_id(coefs: Mapping[str, float], pad_id: Optional[int]) -> None:
    """The draft and indexer-KL parts find padding by ``pad_id`` (their targets / query tokens carry no label
    that marks it, unlike CE's ``labels``); without one they would train on the padding of packed rows."""
    need = [n for n in ("draft", "indexer_kl") if n in active(coefs)]
    if need and pad_id is None:
        raise ValueError(f"loss part(s) {need} are on but pad_id is None: they cannot tell padding from tokens "
                         f"and would average it in; pass pad_id (the tokenizer's pad id, e.g. special_ids()['pad'])")


def compute_losses(params: dict, batch: Mapping[str, torch.Tensor], *, cfg, coefs: Mapping[str, float],
                   forward: Callable, mode: str = "dequant", pad_id: Optional[int] = None,
                   forward_kwargs: Optional[dict] = None, draft_forward: Optional[Callable] = None,
                   draft_anchor_stride: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the forward once and return ``(total, parts)``; only the parts that are on appear in ``parts``.

    ``forward`` has the signature of ``fd.forward``; ``batch`` holds input_ids, positions, labels. ``pad_id`` is
    required when ``draft`` or ``indexer_kl`` is on (``check_pad_id``).
    """
    on = active(coefs)
    if not on:
        raise ValueError(f"every loss coefficient is <= 0 ({dict(coefs)}): nothing to train")
    check_pad_id(coefs, pad_id)
    kw = dict(forward_kwargs or {})
    if "indexer_kl" in on:
        if not _accepts(forward, "aux"):
            raise NotImplementedError("indexer_kl is on but the model forward has no aux=True output yet")
        kw["aux"] = True
    inputs = {"input_ids": batch["input_ids"]}
    if batch.get("positions") is not None:
        inputs["positions"] = batch["positions"]
    out = forward(params, inputs, cfg=cfg, state=None, mode=mode, **kw)
    parts: dict[str, torch.Tensor] = {}
    if "ce" in on:
        parts["ce"] = cross_entropy(out.logits, batch["labels"])
    if "draft" in on:
        if draft_forward is None:
            raise NotImplementedError("the draft loss is on but the model has no DSpark training forward "
                                      "(functional_dsv41.dspark_forward) yet; set --loss.draft=0")
        # n_mtp_layers, not main_hidden: a config can name DSpark target layers (so main_hidden is there)
        # and still have no stages to draft with
        if cfg.n_mtp_layers == 0 or out.main_hidden is None:
            raise ValueError("the draft loss is on but the model has no DSpark stages (n_mtp_layers=0); "
                             "set --loss.draft=0")
        ids = batch["input_ids"]
        anchors = torch.arange(0, ids.shape[1] - 1, max(int(draft_anchor_stride), 1), device=ids.device)
        dkw = {"validate": False} if _accepts(draft_forward, "validate") else {}   # forward checked these inputs
        d = draft_forward(params, out.main_hidden, ids, cfg=cfg, positions=inputs.get("positions"),
                          anchors=anchors, mode=mode, **dkw)            # logits [b, n, B, V], targets [b, n, B]
        tgt = torch.where((d.targets < 0) | (d.targets == pad_id), torch.full_like(d.targets, IGNORE), d.targets)
        parts["draft"] = cross_entropy(d.logits, tgt)
    if "indexer_kl" in on:
        aux = getattr(out, "aux", None) or {}
        parts["indexer_kl"] = indexer_kl(aux.get("indexer", {}), batch["input_ids"] != pad_id)
    total = sum(float(coefs[n]) * parts[n] for n in on)
    return total, parts

