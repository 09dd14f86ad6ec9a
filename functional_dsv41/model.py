"""``forward(params, batch)``: the text model from ``input_ids`` to logits (SPEC §1, §2).

    ids [b, s] --embed--> h [b, s, dim] --repeat--> h [b, s, hc, dim]   (hc identical streams)
    pre = one-hot(stream 0)
    for L in 0..n_layers-1:
        L in engram layers:   h = engram_write(h, n-gram rows)                       (§6)
        L in DSpark targets:  main_hidden += mean over streams of h  (block INPUT)  (§7)
        h, pre = block(h, pre)                                                       (§2: mHC + attention + MoE)
    logits = head_fp32(RMSNorm(sum_k pre_k h_k))                                     [b, s, vocab] fp32

Prefill and decode are one function: the chunk ``[b, s]`` starts at ``state.pos`` (0 without a
state); decode is ``s == 1``. Packed training rows pass ``batch["positions"]`` (positions restarting
at 0 at every sample) and no state: every sample is then isolated (window, compression groups,
indexer, n-grams).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Optional

import torch

from . import engram as engram_mod
from . import sharding, transforms, vision
from .attention import attention
from .compressor import Chunk
from .config import Config, require_config
from .hyper import hc_mixes, hc_post, hc_pre
from .invariant import linear_rows
from .moe import moe
from .norm import rms_norm
from .pytree import _logical_shape, flatten_with_paths, register_carrier
from .state import DecodeState, SharedAttention, begin_append, check_current, config_mismatch, finish_append


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


def block(p: dict, h: torch.Tensor, pre_in: torch.Tensor, *, cfg: Config, layer_id: int, chunk: Chunk, cache,
          shared: SharedAttention, image_mask=None, mode="reference", impl=None, dispatch="sorted",
          qdq: bool = True, debug: dict | None = None, aux: dict | None = None):
    """One block with hyper-connections (SPEC §2). h [b, s, hc, dim] bf16, pre_in [b, s, hc] fp32
    (the previous block's ffn ``pre``) -> (h [b, s, hc, dim] bf16, ffn pre [b, s, hc] fp32, the layer's new
    cache or None, shared)."""
    eps = cfg.norm_eps
    d = {} if debug is not None else None
    res = h
    a_pre, a_post, a_comb = hc_mixes(h, p["hc_attn_fn"], p["hc_attn_scale"], p["hc_attn_base"], cfg=cfg, impl=impl)
    x = rms_norm(hc_pre(h, pre_in, impl=impl), p["attn_norm"]["weight"], eps)
    x, cache, shared, _ = attention(p["attn"], x, cfg=cfg, layer_id=layer_id, chunk=chunk, cache=cache,
                                    shared=shared, mode=mode, impl=impl, qdq=qdq, debug=d, aux=aux)
    h = hc_post(x, res, a_post, a_comb, impl=impl)
    res = h
    f_pre, f_post, f_comb = hc_mixes(h, p["hc_ffn_fn"], p["hc_ffn_scale"], p["hc_ffn_base"], cfg=cfg, impl=impl)
    y = rms_norm(hc_pre(h, a_pre, impl=impl), p["ffn_norm"]["weight"], eps)
    y, (gw, gi) = moe(p["ffn"], y, cfg=cfg, layer_id=layer_id, image_mask=image_mask, mode=mode,
                      impl=impl, dispatch=dispatch, return_routing=True)
    h = hc_post(y, res, f_post, f_comb, impl=impl)
    if debug is not None:
        d.update(attn_out=x, gate_weights=gw, gate_idx=gi, ffn_out=y, h=h, pre_mix=f_pre)
        debug.update({f"layer.{layer_id}.{k}": v for k, v in d.items()})
    return h, f_pre, cache, shared


def _block_aux(p: dict, h: torch.Tensor, pre_in: torch.Tensor, **kw):
    """``block`` with the layer's indexer-KL terms as a fifth result ({} where the layer has none) rather than
    written into a dict the caller passes in: a block wrapper (``train.step.remat``) then sees them as outputs,
    recomputes and differentiates them as it does h."""
    layer_aux: dict = {}
    return (*block(p, h, pre_in, aux=layer_aux, **kw), layer_aux)


def _check_state(state) -> None:
    """Checks that cost no device work, run even with ``validate=False``: a wrong object in ``state=``
    (e.g. the ForwardOutput instead of its ``.state``), a stale state (state.py, "Branching") and a state of
    inference tensors outside ``torch.inference_mode()``."""
    if state is None:
        return
    if not isinstance(state, DecodeState):
        hint = " (pass out.state, not the ForwardOutput)" if isinstance(state, ForwardOutput) else ""
        raise TypeError(f"forward: state must be a DecodeState (fd.init_state) or None, got "
                        f"{type(state).__name__}{hint}")
    check_current(state, "forward")
    if not torch.is_inference_mode_enabled() and any(
            c.compress_kv is not None and c.compress_kv.is_inference() for c in state.layers):
        # else torch's "Inplace update to inference tensor outside InferenceMode" from inside attention
        raise ValueError("forward: this DecodeState was built under torch.inference_mode() and forward appends to "
                         "its histories in place, which torch allows only inside inference_mode: run this forward "
                         "under torch.inference_mode() too, or continue from fd.clone_state(state)")


def _not_int_tensor(t) -> Optional[str]:
    """What ``t`` is (its dtype, or its type's name) when it is not an integer tensor; None when it is one."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return str(t.dtype)
    return None


def _check_token_types(batch: dict, data: bool) -> None:
    """token_types: an integer tensor shaped like input_ids. ``data`` (a device sync): image positions
    (>= 0) need images, as images need token_types (vision.merge_image_embeddings) - spans without
    images would silently run as text tokens with the image routing bias and Engram gating."""
    tt, ids = batch.get("token_types"), batch["input_ids"]
    if tt is None:
        return
    got = _not_int_tensor(tt)
    if got:
        raise TypeError(f"forward: token_types must be an integer tensor [b, s] (-1 text, 0..3 image span), "
                        f"got {got}")
    if tuple(tt.shape) != tuple(ids.shape):
        raise ValueError(f"forward: token_types {tuple(tt.shape)} must match input_ids {tuple(ids.shape)}")
    if data:
        lo, hi = int(tt.min()), int(tt.max())
        if lo < -1 or hi > 3:                   # -5 ran as text silently
            raise ValueError(f"forward: token_types holds {lo if lo < -1 else hi}; the types are -1 (text), "
                             f"0 IMAGE_START, 1 IMAGE, 2 IMAGE_NEW_LINE, 3 IMAGE_END")
    if data and batch.get("images") is None and bool((tt >= 0).any()):
        raise ValueError("forward: token_types marks image positions (>= 0) but batch has no 'images' "
                         "(one entry per row, image_processor.load_image); text positions are -1")


BATCH_KEYS = ("input_ids", "positions", "token_types", "images")
LOSS_KEYS = ("labels",)         # the training batch's (train.data.make_labels): the loss reads it, forward need not


def _check_batch(batch) -> None:
    """Host-only checks of the batch dict, run even with ``validate=False``: ``input_ids`` present and no key
    forward does not read (but the training batch's ``labels``). A misspelt or foreign key (``position_ids``,
    ``image``) would otherwise be ignored silently, running packed samples unisolated or images as text."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("forward: batch must be a dict with 'input_ids' (int64 [b, s])")
    unknown = [k for k in batch if k not in BATCH_KEYS + LOSS_KEYS]
    if unknown:
        raise ValueError(f"forward: batch has keys that forward does not read: {unknown} (known: {list(BATCH_KEYS)}, "
                         f"and {list(LOSS_KEYS)}, which the training loss reads)")


def _check_ids(batch: dict) -> None:
    """input_ids' type, dtype and rank: host-only, so run even with ``validate=False`` (a float id was
    truncated to an integer silently there, 1-D ids failed with "not enough values to unpack")."""
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"forward: input_ids must be a tensor, got {type(ids).__name__}")
    if _not_int_tensor(ids):
        raise TypeError(f"forward: input_ids must be an integer tensor, got {ids.dtype}")
    if ids.dim() != 2:
        hint = (" (under torch.func.vmap an example's ids are [seq]: pass x[None])"
                if ids.dim() == 1 and transforms.vmapped(ids) else "")
        raise ValueError(f"forward: input_ids must be [batch, seq], got shape {tuple(ids.shape)}{hint}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"forward: empty input_ids of shape {tuple(ids.shape)}")


def _check_inputs(params: dict, batch: dict, cfg: Config, state: Optional[DecodeState]):
    ids = batch["input_ids"]
    b, s = ids.shape
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"forward: token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    if state is None and s > cfg.max_seq_len:
        raise ValueError(f"forward: chunk of {s} tokens at position 0 runs past max_seq_len {cfg.max_seq_len}")
    _check_params(params, cfg)


# the stages and the vision tower are read only by dspark_forward / with images: absent is fine for forward
_OPTIONAL_PARAMS = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")


@functools.lru_cache(maxsize=8)
def _param_entries(cfg: Config) -> dict:
    """{path: Entry} of every tensor of ``param_spec(cfg)``, scales included (storage shapes and dtypes)."""
    from .params.spec import spec_entries
    return {e.name: e for e in spec_entries(cfg)}


_STACKED = re.compile(r"(.*\.experts)\.(\d+)(\..*)")   # layers.L.ffn.experts.E.w1.weight -> ...experts / E / .w1.weight
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)     # a plain tensor or a float master weight
_EXTRA_LEAVES = ("engram_token_map",)          # built by load_params from the tokenizer, not a released tensor


def _spec_name(path: str, entries: dict) -> str | None:
    """The spec entry a tree path stands for: itself, or expert 0's for the stacked experts form
    (``...experts.w1.weight`` [E, ...], sharding.py)."""
    if path in entries:
        return path
    head, dot, rest = path.partition(".experts.")
    if dot and f"{head}.experts.0.{rest}" in entries:
        return f"{head}.experts.0.{rest}"
    return None


def _check_params(params, cfg: Config) -> None:
    """The params against the config (host-only): every weight's shape (``param_spec``'s logical shapes, fp4
    unpacked) and dtype (a quantized weight in its storage dtype with its ``scale``, or a float master weight;
    every other tensor a float), and no leaf the config does not have. Without it a config changed in a notebook
    without new params failed deep inside torch ("shape '[1, 6, 8, 64]' is invalid"), with a KeyError, or ran on
    the params' own sizes; an integer weight was cast and run; a misspelt override was ignored."""
    if not isinstance(params, dict):
        raise TypeError(f"forward: params must be the parameter tree (a dict, fd.init_params / fd.load_params), "
                        f"got {type(params).__name__}")
    n = len(params.get("layers", ()))
    if n != cfg.n_layers:
        raise ValueError(f"forward: params have {n} layers, config has {cfg.n_layers}")
    flat = flatten_with_paths(params)
    entries = _param_entries(cfg)
    problems = []
    for name, e in entries.items():
        if e.fmt == "scale":
            continue                            # checked beside its weight (master trees have none)
        want = tuple(e.logical)
        t = flat.get(name)
        stacked = None if t is not None else _STACKED.fullmatch(name)
        if stacked is not None and isinstance(flat.get(stacked[1] + stacked[3]), torch.Tensor):
            # the stacked experts form (sharding.py): ...experts.w1.weight [E, ...] holds expert e in row e
            t = flat[stacked[1] + stacked[3]]
            if t.dim() == 0 or t.shape[0] <= int(stacked[2]):
                problems.append(f"{stacked[1] + stacked[3]} has no expert {stacked[2]} (shape {tuple(t.shape)})")
                continue
            got = _logical_shape(t)[1:]
            if got != want:
                problems.append(f"{name} (row {stacked[2]} of {stacked[1] + stacked[3]}) is {got}, expected {want}")
            if stacked[2] == "0":
                problems += _dtype_problems(stacked[1] + stacked[3], t, e, flat)
            continue
        if t is None:
            if not name.startswith(_OPTIONAL_PARAMS):
                problems.append(f"{name} is missing (expected {want})")
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} is a {type(t).__name__}, not a tensor")
            continue
        got = _logical_shape(t)                 # packed fp4 [N, K/2] is [N, K]
        if got != want:
            problems.append(f"{name} is {got}, expected {want}")
        problems += _dtype_problems(name, t, e, flat)
    extra = [p for p in flat if p not in _EXTRA_LEAVES and _spec_name(p, entries) is None]
    problems += [f"{p} is not a parameter of this config" for p in extra]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"forward: params do not match the config ({len(problems)} problem(s)): "
                         + "; ".join(problems[:3]) + more + " - params built for another config, or edited?")


def _dtype_problems(path: str, t: torch.Tensor, e, flat: dict) -> list:
    """What is wrong with the dtype of weight ``t`` at ``path`` (spec entry ``e``): [] or one message."""
    if e.fmt in ("fp8", "fp4", "rows") and t.dtype == e.dtype:
        scale = path[:-len("weight")] + "scale"
        if not isinstance(flat.get(scale), torch.Tensor):
            return [f"{path} is stored as {t.dtype} but {scale} is missing"]
        return []
    if t.dtype in _FLOATS:
        return []
    want = f"{e.dtype} with its .scale, or a float master weight" if e.fmt in ("fp8", "fp4", "rows") else "a float"
    return [f"{path} is {t.dtype}, expected {want}"]


def _check_state_fits(batch: dict, cfg: Config, state: Optional[DecodeState]) -> None:
    """The state against the chunk and the config: host-only, so run even with ``validate=False`` (the decode
    loops' setting), where a state of another batch size failed deep inside torch and one of another config
    (same shapes, e.g. another index_topk) ran silently."""
    ids = batch["input_ids"]
    if state is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    b, s = ids.shape
    if state.pos + s > state.max_seq_len:
        raise ValueError(f"forward: chunk of {s} tokens at position {state.pos} runs past max_seq_len "
                         f"{state.max_seq_len}")
    if (why := config_mismatch(state.config_id, cfg)) is not None:
        raise ValueError(f"forward: {why}")
    if state.batch_size != b:
        raise ValueError(f"forward: the state holds {state.batch_size} rows, the batch has {b}")
    sdev = state.layers[0].window_kv.device if state.layers else ids.device
    if sdev != ids.device:
        raise ValueError(f"forward: the state is on {sdev} but input_ids are on {ids.device}: build it with "
                         f"fd.init_state(cfg, ..., device={str(ids.device)!r}) (forward computes on input_ids' device)")
    if "positions" in batch:
        raise ValueError("forward: packed 'positions' are for stateless (training) calls only")


def make_chunk(batch: dict, start: int, device) -> Chunk:
    """The positions of this call's tokens (``compressor.Chunk``): batch["input_ids"] [b, s] starting at absolute
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
        raise TypeError(f"forward: positions must be an integer tensor [b, s], got {got}")
    pos = pos.to(device=device, dtype=torch.long)
    if pos.shape != ids.shape:
        raise ValueError(f"forward: positions {tuple(pos.shape)} must match input_ids {tuple(ids.shape)}")
    seg_start = pos_abs - pos
    if bool((pos < 0).any() | (seg_start < 0).any() | (pos[:, 1:] != pos[:, :-1] + 1)[pos[:, 1:] != 0].any()):
        raise ValueError("forward: positions must count 0, 1, 2, ... within each packed sample (none negative)")
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
