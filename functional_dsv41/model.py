"""``forward(params, batch)``: the text model from ``input_ids`` to logits (SPEC §1, §2).

    ids [b, s] --embed--> h [b, s, dim] --repeat--> h [b, s, hc, dim]   (hc identical streams)
    pre = one-hot(stream 0)
    for L in 0..n_layers-1:
        L in engram layers:   h = engram_write(h, n-gram rows)                       (§6)
        L in DSpark targets:  main_hidden += mean over streams of h  (block INPUT)  (§7)
        h, pre = block(h, pre)                                                       (§2: mHC + attention + MoE)
    logits = head_fp32(RMSNorm(sum_k pre_k h_k))                                     [b, s, vocab] fp32

The logits cover every position (training needs them; DESIGN "Public API"); the release's forward keeps the last
one only (SPEC §1: ``[:, -1]``), which is ``logits[:, -1]`` here, the same values.

Prefill and decode are one function: the chunk ``[b, s]`` starts at ``state.pos`` (0 without a
state); decode is ``s == 1``. Packed training rows pass ``batch["positions"]`` (positions restarting
at 0 at every sample) and no state: every sample is then isolated (window, compression groups,
indexer, n-grams). The checks ``forward`` runs on its inputs before any of this are in ``validate.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from . import engram as engram_mod
from . import sharding, transforms, vision
from .attention import attention
from .config import Config, require_config
from .hyper import hc_mixes, hc_post, hc_pre
from .invariant import linear_rows
from .moe import moe
from .norm import rms_norm
from .pytree import register_carrier
from .state import Chunk, DecodeState, SharedAttention, begin_append, finish_append
from .validate import (_check_batch, _check_ids, _check_inputs, _check_state, _check_state_fits, _check_token_types,
                       _not_int_tensor)


@register_carrier
@dataclass(frozen=True)
class ForwardOutput:
    """logits [b, s, V] fp32; state (DecodeState or None); main_hidden [b, s, n_targets*dim] bf16.

    With return_hidden: hidden[L] [b, s, hc, dim], pre_mix[L] [b, s, hc], topk[L] [b, s, k] (index
    sources; compressed-entry indices, -1 = none), candidates [b, s, n] bool, engram_ids
    [b, s, n_engram_layers, (max_ngram-1)*heads].
    """
    logits: torch.Tensor
    state: Optional[DecodeState] = None
    main_hidden: Optional[torch.Tensor] = None
    hidden: Optional[dict] = None
    pre_mix: Optional[dict] = None
    topk: Optional[dict] = None
    candidates: Optional[torch.Tensor] = None
    engram_ids: Optional[torch.Tensor] = None
    aux: Optional[dict] = None


def mhc_block(p: dict, h: torch.Tensor, pre_in: torch.Tensor, attend, *, cfg: Config, layer_id: int,
              image_mask=None, mode="reference", impl=None, dispatch="sorted", debug: dict | None = None,
              debug_prefix: str = ""):
    """One block with hyper-connections (SPEC §2) around the attention ``attend``: mixes, RMSNorm, attention, mixes,
    RMSNorm, MoE. ``attend(x, d)`` maps the normed input [b, s, dim] to the attention output [b, s, dim]; ``d`` is the
    dict its debug tensors go into (None without ``debug``). ``block`` passes ``attention``; a DSpark stage
    (``dspark._stages``) its draft attention over the main-KV ring (SPEC §7: otherwise a full block).
    h [b, s, hc, dim] bf16, pre_in [b, s, hc] fp32 (the previous block's ffn ``pre``) -> (h, ffn pre [b, s, hc] fp32).
    ``debug`` gets d's entries, then attn_out, gate_weights, gate_idx, ffn_out, h and pre_mix, each key prefixed
    with ``debug_prefix``."""
    eps = cfg.norm_eps
    d = {} if debug is not None else None
    res = h
    a_pre, a_post, a_comb = hc_mixes(h, p["hc_attn_fn"], p["hc_attn_scale"], p["hc_attn_base"], cfg=cfg, impl=impl)
    x = rms_norm(hc_pre(h, pre_in, impl=impl), p["attn_norm"]["weight"], eps)
    x = attend(x, d)
    h = hc_post(x, res, a_post, a_comb, impl=impl)
    res = h
    f_pre, f_post, f_comb = hc_mixes(h, p["hc_ffn_fn"], p["hc_ffn_scale"], p["hc_ffn_base"], cfg=cfg, impl=impl)
    y = rms_norm(hc_pre(h, a_pre, impl=impl), p["ffn_norm"]["weight"], eps)
    y, (gw, gi) = moe(p["ffn"], y, cfg=cfg, layer_id=layer_id, image_mask=image_mask, mode=mode,
                      impl=impl, dispatch=dispatch, return_routing=True)
    h = hc_post(y, res, f_post, f_comb, impl=impl)
    if debug is not None:
        d.update(attn_out=x, gate_weights=gw, gate_idx=gi, ffn_out=y, h=h, pre_mix=f_pre)
        debug.update({f"{debug_prefix}{k}": v for k, v in d.items()})
    return h, f_pre


def block(p: dict, h: torch.Tensor, pre_in: torch.Tensor, *, cfg: Config, layer_id: int, chunk: Chunk, cache,
          shared: SharedAttention, image_mask=None, mode="reference", impl=None, dispatch="sorted",
          qdq: bool = True, debug: dict | None = None, aux: dict | None = None):
    """One backbone block (SPEC §2): ``mhc_block`` around ``attention``. h [b, s, hc, dim] bf16, pre_in [b, s, hc]
    fp32 (the previous block's ffn ``pre``) -> (h [b, s, hc, dim] bf16, ffn pre [b, s, hc] fp32, the layer's new
    cache or None, shared)."""
    def attend(x, d):
        nonlocal cache, shared                  # the layer's new cache and shared slots: block returns them
        x, cache, shared, _ = attention(p["attn"], x, cfg=cfg, layer_id=layer_id, chunk=chunk, cache=cache,
                                        shared=shared, mode=mode, impl=impl, qdq=qdq, debug=d, aux=aux)
        return x

    h, pre = mhc_block(p, h, pre_in, attend, cfg=cfg, layer_id=layer_id, image_mask=image_mask, mode=mode,
                       impl=impl, dispatch=dispatch, debug=debug, debug_prefix=f"layer.{layer_id}.")
    return h, pre, cache, shared


def _block_aux(p: dict, h: torch.Tensor, pre_in: torch.Tensor, **kw):
    """``block`` with the layer's indexer-KL terms as a fifth result ({} where the layer has none) rather than
    written into a dict the caller passes in: a block wrapper (``train.step.remat``) then sees them as outputs,
    recomputes and differentiates them as it does h."""
    layer_aux: dict = {}
    return (*block(p, h, pre_in, aux=layer_aux, **kw), layer_aux)


def make_chunk(batch: dict, start: int, device, where: str = "forward") -> Chunk:
    """The positions of this call's tokens (``state.Chunk``): batch["input_ids"] [b, s] starting at absolute
    position ``start``; without batch["positions"] every row is one sample (pos = pos_abs, seg_start 0); with
    positions [b, s] (packed samples restart at 0) each token's sample start follows from them (checked)."""
    ids = batch["input_ids"]
    b, s = ids.shape
    pos_abs = torch.arange(start, start + s, device=device)
    pos = batch.get("positions")
    if pos is None:
        return Chunk(start, pos_abs, pos_abs.expand(b, s), torch.zeros(b, s, dtype=torch.long, device=device))
    got = _not_int_tensor(pos)
    if got:
        raise TypeError(f"{where}: positions must be an integer tensor [b, s], got {got}")
    pos = pos.to(device=device, dtype=torch.long)
    if pos.shape != ids.shape:
        raise ValueError(f"{where}: positions {tuple(pos.shape)} must match input_ids {tuple(ids.shape)}")
    seg_start = pos_abs - pos
    if bool((pos < 0).any() | (seg_start < 0).any() | (pos[:, 1:] != pos[:, :-1] + 1)[pos[:, 1:] != 0].any()):
        raise ValueError(f"{where}: positions must count 0, 1, 2, ... within each packed sample (none negative)")
    return Chunk(start, pos_abs, pos, seg_start, packed=True)


def forward(params: dict, batch: dict, *, cfg: Config, state: Optional[DecodeState] = None,
            return_hidden: bool = False, mode: str = "reference", impl: str | None = None,
            dispatch: str = "sorted", qdq: bool = True, validate: bool = True, aux: bool = False,
            block_wrapper=None, debug: dict | None = None) -> ForwardOutput:
    """Run the backbone on a chunk. See the module docstring; DESIGN.md "Public API".

    params: the parameter tree (``fd.load_params`` / ``fd.init_params``); batch: {"input_ids" int64
    [b, s], optional "positions" [b, s] (packed samples), optional "token_types" [b, s] (>= 0: image
    span), optional "images": one entry per row, None or a list of ``(patches bf16 [n_vit_h*n_vit_w, 3,
    14, 14], (n_vit_h, n_vit_w))`` in span order (``image_processor.load_image``; needs token_types and a
    chunk at position 0; see ``vision``)}; state: a DecodeState (``fd.init_state``) or None.
    ``mode``: linear() mode ("reference", "dequant", "qat"). "reference" runs the release's fp8/fp4 GEMMs only on
    weights STORED as fp8/fp4; float master weights (``init_params(master=True)``) give the "dequant" model there;
    evaluate a QAT master tree with "qat", or export it (``params.train_state.to_storage``) first. ``dispatch``: MoE
    formulation ("sorted" scales; "dense" works under vmap).
    ``qdq=False``: no activation quantisation outside linear() (the KV / indexer QDQ; a smooth model for gradient
    checks with "dequant"; "qat" still fake-quantises every fp8/fp4 linear's input). ``validate=False``
    skips the data-dependent input checks (needed under ``torch.func.vmap``). ``aux=True``: also return
    ``out.aux["indexer"][L] = {"teacher", "student", "valid"}`` per index-source layer (the indexer
    KL loss, ``attention.indexer_kl_terms``). ``block_wrapper``: applied to the per-block function
    (``block_wrapper(block)(p, h, pre, ...)``), e.g. activation checkpointing (``train.step.remat``).
    ``debug``: a dict to receive intermediate tensors keyed like the golden files.

    Length: without a state a chunk may be at most ``cfg.max_seq_len`` tokens (as the reference, whose RoPE table
    is that long); with one, up to the state's own ``max_seq_len`` (``init_state``'s, which may be larger).

    State: the returned ``out.state`` continues ``state``; ``state`` itself stays valid (shorter).
    The compressed-KV histories are preallocated buffers shared along a history (no copy per step),
    so growing a state again overwrites what its earlier continuations wrote: those continuations
    (every state of the history past ``state.pos``) become stale, and passing one to ``forward``
    raises a ValueError saying so. To keep two futures of one state, branch with
    ``fd.clone_state(state)`` (one copy of the buffers) and grow one future from each copy.
    Under reverse-mode autograd (the new rows or the state's history require grad) the history is copied rather
    than appended in place, so that gradients reach the rows earlier chunks wrote.

    Under torch.func (tests/test_func.py): ``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd`` and ``jvp(grad)`` run
    with the defaults. ``vmap`` (``vmap(grad)`` too) runs over examples (``x[None]`` each: input_ids [1, s], with
    token_types, unbatched positions), over stacked param trees or any subset of their leaves (in_dims None for
    the rest), over image patches, or several of these, in every mode, with qdq, return_hidden, aux and debug;
    pass ``validate=False`` when an input is batched and ``dispatch="dense"`` when anything that reaches the MoE
    routers is (a head-only ensemble runs with the defaults). Under vmap every op runs the torch reference
    (``impl="auto"`` / None: functorch refuses the TileLang ops' autograd.Functions there). Refused by name:
    ``impl="tilelang"``, batched ``positions``, token rows batched together with images, and a DecodeState with
    anything reaching the routers batched (its histories are appended in place); ``block_wrapper=
    train.step.remat`` has no vmap rule (torch refuses it). A vmapped image batch is not bit-identical to the
    loop: the ViT's bf16 linears round differently under vmap.
    """
    require_config(cfg, "forward")
    _check_state(state)
    _check_batch(batch)
    _check_ids(batch)
    transforms.check_unsharded(params)          # (inside a torch.func transform only)
    if transforms.under_vmap():
        impl = transforms.check_vmap(params, batch, cfg, state, validate=validate, dispatch=dispatch, impl=impl)
    if validate:
        _check_inputs(params, batch, cfg, state)
    _check_state_fits(batch, cfg, state)
    _check_token_types(batch, data=validate)
    ids = batch["input_ids"].long()
    b, s = ids.shape
    dev = ids.device
    start = state.pos if state is not None else 0
    chunk = make_chunk(batch, start, dev)
    tt = batch.get("token_types")
    image_mask = (tt >= 0) if tt is not None else None

    ng_ids, ngram = None, None
    if cfg.engram_layer_ids:
        token_map = params.get("engram_token_map")
        if token_map is None:
            raise ValueError("forward: params lack 'engram_token_map' (load_params builds it from the checkpoint's "
                             "tokenizer.json; init_params(cfg, tokenizer=...) too)")
        ng_ids, ngram = engram_mod.hash_ids(ids, cfg=cfg, token_map=token_map, image_mask=image_mask,
                                            cache=state.ngram if state is not None else None,
                                            positions=batch.get("positions"), check=validate)

    h = sharding.embedding(ids, params["embed"]["weight"])  # (= F.embedding; rows may be split: sharding.py)
    if batch.get("images") is not None:       # SPEC §1/§12: overwrite image spans (chunk at 0 only)
        h = vision.merge_image_embeddings(params, h, batch, cfg=cfg, start=start, debug=debug)
    if debug is not None:
        debug["embed"] = h
        if ng_ids is not None:
            debug["engram_hash"] = ng_ids
    h = h.unsqueeze(2).expand(b, s, cfg.hc_mult, cfg.dim).contiguous()
    pre = torch.zeros(b, s, cfg.hc_mult, dtype=torch.float32, device=dev)
    pre[..., 0] = 1.0
    shared = SharedAttention()
    caches = list(state.layers) if state is not None else [None] * cfg.n_layers
    # staleness bookkeeping (state.py "Branching"): after the input checks, before the first history write
    stamps = begin_append(state, start + s) if state is not None else None
    main_hidden, hidden, pre_mix = [], {}, {}
    aux_indexer = {} if aux else None
    blk = _block_aux if aux else block
    run_block = blk if block_wrapper is None else block_wrapper(blk)
    for L in cfg.layer_ids:
        p = params["layers"][L]
        e = cfg.engram_index(L)
        if e is not None:
            h = engram_mod.engram_write(p["engram"], h, ng_ids[:, :, e], cfg=cfg, image_mask=image_mask, mode=mode,
                                        check=validate, impl=impl)
            if debug is not None:
                debug[f"layer.{L}.engram_out"] = h
        if L in cfg.dspark_target_layer_ids:
            main_hidden.append(h.mean(dim=2))
        out = run_block(p, h, pre, cfg=cfg, layer_id=L, chunk=chunk, cache=caches[L], shared=shared,
                        image_mask=image_mask, mode=mode, impl=impl, dispatch=dispatch, qdq=qdq, debug=debug)
        h, pre, caches[L], shared = out[:4]
        if aux and out[4]:
            aux_indexer[L] = out[4]
        if return_hidden:
            hidden[L], pre_mix[L] = h, pre

    x = rms_norm(hc_pre(h, pre, impl=impl), params["norm"]["weight"], cfg.norm_eps)
    logits = sharding.vocab_logits(x.float(), params["head"]["weight"], linear_rows)   # fp32 [b, s, V]
    new_state = None
    if state is not None:
        new_state = dataclasses.replace(state, pos=start + s, layers=finish_append(caches, stamps), ngram=ngram)
    mh = torch.cat(main_hidden, -1) if main_hidden else None
    if debug is not None and mh is not None:
        debug["main_hidden"] = mh
    aux_out = {"indexer": aux_indexer} if aux else None
    if not return_hidden:
        return ForwardOutput(logits, new_state, mh, aux=aux_out)
    return ForwardOutput(logits, new_state, mh, hidden, pre_mix, dict(shared.topk), shared.candidates, ng_ids,
                         aux_out)
