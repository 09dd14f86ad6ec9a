"""The functional training step: ``torch.func.grad_and_value`` over the trainable leaves only.

The params tree is split once (``split_params``) into
  - ``trainable``: float leaves, held as fp32 master weights ``{path: tensor}`` — the differentiated
    argument, and the only leaves with optimizer state;
  - ``frozen``: everything else — the Engram tables (``layers.*.engram.embed.*`` by default, plus any
    ``frozen`` glob the caller adds) and every non-float leaf (fp8/fp4 storage, e8m0 scales, int
    buffers such as ``engram_token_map``). They are closed over, get no gradient, never change.
For the forward, each master leaf is cast to its compute dtype (the release's storage dtype for plain
tensors, e.g. bf16 norms/embeddings; fp32 for weights the release stores fp8/fp4, which ``linear()``
consumes as float masters — fake-quantised in ``mode="qat"``). The cast is differentiable, so the
fp32 masters receive the gradient of the bf16 computation.

``make_step`` returns ``step(trainable, opt_state, batch, *, lr, step_no) -> (trainable, opt_state,
metrics)``: loss parts (train/loss.py), global-norm clipping, functional AdamW; nothing is modified
in place. Metrics: ``tokens`` counts the targets, ``tokens_per_s`` the non-padding input tokens (every
slot when no ``pad_id`` is given) per second of step time. A non-finite loss part or gradient raises
``NonFiniteError`` naming the step and the part / leaves, before any update is applied.

``remat(fn)``: activation checkpointing that works under ``torch.func.grad`` / ``grad_and_value`` and
``torch.autograd`` (``torch.utils.checkpoint`` does not: torch.func refuses saved-tensor hooks); not under
``jvp`` or ``vmap``, which would need a forward-mode rule and a batching rule for its autograd.Function. The forward of the
wrapped function runs without saving intermediates; the backward recomputes it with
``torch.func.vjp``. It needs a hook in the model to wrap each block (see ``remat_forward_kwargs``).
"""
from __future__ import annotations

import fnmatch
import inspect
import time
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.utils._pytree as tpt
from torch.func import grad_and_value, vjp

from functional_dsv41.pytree import flatten_with_paths, unflatten_from_paths

from . import loss as loss_mod
from . import optim

FROZEN_DEFAULT = ("layers.*.engram.embed.*",)

# leaves that only one loss part reaches: the indexer (its inputs are detached; its scores select slots, which
# carries no gradient) only the indexer-KL, the DSpark stages only the draft loss
REACHED_ONLY_BY = {"indexer_kl": ("layers.*.attn.indexer.*",), "draft": ("mtp.*",)}


def unreached_patterns(coefs: Mapping[str, float]) -> tuple[str, ...]:
    """Globs of the params no active loss part reaches (``REACHED_ONLY_BY``), to freeze with the rest: their
    gradient is exactly zero (``torch.func.grad`` returns zeros, not None), and AdamW's decoupled weight decay
    would still shrink them every step - an indexer trained by CE alone would decay towards selecting at random.
    ``torch.optim.AdamW`` skips such a parameter (its grad is None); freezing it here does the same."""
    return tuple(p for part, pats in REACHED_ONLY_BY.items() if coefs.get(part, 0) <= 0 for p in pats)


class NonFiniteError(FloatingPointError):
    """A loss part or a gradient went non-finite; the message names the step and what."""


# ----------------------------------------------------------------------------- param split
def split_params(params, frozen: Iterable[str] = FROZEN_DEFAULT
                 ) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """``(trainable, frozen)`` flat dicts (module docstring). Trainable leaves are fp32 copies."""
    pats = tuple(frozen)
    tr, fr = {}, {}
    for k, v in flatten_with_paths(params).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.element_size() >= 2 \
                and not any(fnmatch.fnmatchcase(k, p) for p in pats):
            tr[k] = v.detach().to(torch.float32).clone()
        else:
            fr[k] = v
    if not tr:
        raise ValueError("split_params: no trainable float leaves (is every parameter frozen or quantized?)")
    return tr, fr


def compute_dtypes(cfg, trainable: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """Forward dtype of every trainable leaf: ``param_spec(cfg, master=True)``'s dtype (module docstring)."""
    import functional_dsv41 as fd
    spec = flatten_with_paths(fd.param_spec(cfg, master=True))
    missing = sorted(set(trainable) - set(spec))
    if missing:
        raise KeyError(f"trainable leaves not in param_spec(cfg): {missing[:5]}")
    return {k: spec[k].dtype for k in trainable}


def assemble(trainable: Mapping[str, torch.Tensor], frozen: Mapping[str, object],
             dtypes: Optional[Mapping[str, torch.dtype]] = None):
    """The nested params tree for the forward: masters cast to ``dtypes``, frozen leaves as they are."""
    flat = dict(frozen)
    for k, v in trainable.items():
        flat[k] = v.to(dtypes[k]) if dtypes is not None else v
    return unflatten_from_paths(flat)


# ----------------------------------------------------------------------------- remat
class _Remat(torch.autograd.Function):
    @staticmethod
    def forward(run, n_in, *tensors):
        ids = {id(t) for t in tensors}
        # an input passed straight through (e.g. a KV tensor another layer published) must come back as
        # a view, or autograd refuses to save it
        return tuple(o.view_as(o) if id(o) in ids else o for o in run(*tensors))

    @staticmethod
    def setup_context(ctx, inputs, output):
        run, n_in, *tensors = inputs
        ctx.run = run
        ctx.save_for_backward(*tensors)
        ctx.float_out = [i for i, o in enumerate(output) if o.is_floating_point()]
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])

    @staticmethod
    def backward(ctx, *gouts):
        ins = ctx.saved_tensors
        fl = [i for i, t in enumerate(ins) if t.is_floating_point()]

        def f(*fts):
            args = list(ins)
            for i, t in zip(fl, fts):
                args[i] = t
            return tuple(o for o in ctx.run(*args) if o.is_floating_point())

        with torch.enable_grad():
            outs, pull = vjp(f, *[ins[i] for i in fl])
        cot = tuple(gouts[i] if gouts[i] is not None else torch.zeros_like(o)
                    for i, o in zip(ctx.float_out, outs))
        grads = pull(cot)
        res: list = [None] * len(ins)
        for i, g in zip(fl, grads):
            res[i] = g
        return (None, None, *res)


def remat(fn: Callable) -> Callable:
    """``fn`` with activation checkpointing (module docstring). Arguments and results may be pytrees;
    tensors among them are the saved inputs / outputs, everything else passes through unchanged."""

    def wrapped(*args, **kwargs):
        flat, spec = tpt.tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        box: dict = {}

        def run(*ts):
            f = list(flat)
            for i, t in zip(idx, ts):
                f[i] = t
            a, k = tpt.tree_unflatten(f, spec)
            out_flat, out_spec = tpt.tree_flatten(fn(*a, **k))
            box["spec"], box["flat"] = out_spec, out_flat
            return tuple(o for o in out_flat if isinstance(o, torch.Tensor))

        touts = _Remat.apply(run, len(idx), *[flat[i] for i in idx])
        it = iter(touts)
        out_flat = [next(it) if isinstance(o, torch.Tensor) else o for o in box["flat"]]
        return tpt.tree_unflatten(out_flat, box["spec"])

    return wrapped


REMAT_HOOK = "block_wrapper"


def remat_forward_kwargs(forward: Callable) -> dict:
    """Forward kwargs that turn on per-block remat, or a clear error if the model has no hook for it."""
    try:
        ok = REMAT_HOOK in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise NotImplementedError(
            f"activation checkpointing needs the model forward to accept `{REMAT_HOOK}=` (a callable "
            f"that wraps the per-block function: `{REMAT_HOOK}(block)(p, h, pre, ...)`); this forward "
            f"does not. Run without --remat.")
    return {REMAT_HOOK: remat}


# ----------------------------------------------------------------------------- the step
def _nonfinite_leaves(tree: Mapping[str, torch.Tensor]) -> list[str]:
    return [k for k, v in tree.items() if not bool(torch.isfinite(v).all())]


def _check_finite(step_no: int, parts: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
                  gnorm: torch.Tensor, params: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    bad = [k for k, v in parts.items() if not bool(torch.isfinite(v))]
    if bad:
        bad_p = _nonfinite_leaves(params) if params is not None else []
        raise NonFiniteError(f"step {step_no}: non-finite loss part(s) "
                             + ", ".join(f"{k}={float(parts[k])}" for k in bad)
                             + (f"; non-finite parameter(s): {', '.join(bad_p[:8])}" if bad_p else ""))
    if not bool(torch.isfinite(gnorm)):
        leaves = [k for k, g in grads.items() if not bool(torch.isfinite(g).all())]
        raise NonFiniteError(f"step {step_no}: non-finite gradient (global norm {float(gnorm)}) in "
                             f"{len(leaves)} leaf/leaves: {', '.join(leaves[:8])}"
                             + (" ..." if len(leaves) > 8 else ""))


def make_step(cfg, *, frozen: Mapping[str, object], dtypes: Mapping[str, torch.dtype],
              forward: Callable, coefs: Mapping[str, float], mode: str = "dequant",
              adamw: optim.AdamWConfig = optim.AdamWConfig(), clip: float = 1.0, pad_id: Optional[int] = None,
              forward_kwargs: Optional[dict] = None, draft_forward: Optional[Callable] = None,
              draft_anchor_stride: int = 1) -> Callable:
    """Build ``step(trainable, opt_state, batch, *, lr, step_no)`` (module docstring)."""
    loss_mod.active(coefs)  # validates the names early
    loss_mod.check_pad_id(coefs, pad_id)   # and refuses a draft / indexer-KL that could not mask padding

    def loss_fn(trainable, batch):
        params = assemble(trainable, frozen, dtypes)
        total, parts = loss_mod.compute_losses(params, batch, cfg=cfg, coefs=coefs, forward=forward, mode=mode,
                                               pad_id=pad_id, forward_kwargs=forward_kwargs,
                                               draft_forward=draft_forward,
                                               draft_anchor_stride=draft_anchor_stride)
        return total, {k: v.detach() for k, v in parts.items()}

    gv = grad_and_value(loss_fn, argnums=0, has_aux=True)

    def step(trainable, opt_state, batch, *, lr: float, step_no: int):
        t0 = time.perf_counter()
        try:
            grads, (total, parts) = gv(trainable, batch)
        except (ValueError, RuntimeError, FloatingPointError) as e:
            # a non-finite weight can make the forward itself refuse (e.g. a quantizer's scale check)
            bad = _nonfinite_leaves(trainable)
            if bad:
                raise NonFiniteError(f"step {step_no}: non-finite parameter(s) {', '.join(bad[:8])} "
                                     f"(the forward raised {type(e).__name__}: {e})") from e
            raise
        parts = {**parts, "total": total.detach()}
        clipped, gnorm = optim.clip_by_global_norm(grads, clip)
        _check_finite(step_no, parts, grads, gnorm, trainable)
        new_tr, new_opt = optim.adamw_update(clipped, opt_state, trainable, lr=lr, cfg=adamw)
        n_tok = int((batch["labels"] != loss_mod.IGNORE).sum())
        ids = batch["input_ids"]
        n_real = ids.numel() if pad_id is None else int((ids != pad_id).sum())   # padding slots are no throughput
        dt = time.perf_counter() - t0
        metrics = {**{f"loss/{k}": float(v) for k, v in parts.items()}, "lr": lr,
                   "grad_norm": float(gnorm), "tokens": n_tok, "step_time": dt,
                   "tokens_per_s": n_real / dt}
        return new_tr, new_opt, metrics

    return step
