"""``forward`` under ``torch.func`` transforms: whether a vmap is active, and the setups it cannot run, refused by
name before they fail deep inside torch ("calling .item()", "Cannot access data pointer of Tensor that doesn't have
storage", "inplace arithmetic ... vmapped over", "You tried to vmap over _HcSplitSinkhorn").

What runs (forward's docstring, "Under torch.func"; tests/test_func.py): grad, vjp, jvp, jacrev, jacfwd with the
defaults; vmap over examples (``x[None]`` each), stacked param trees or any subset of their leaves, image patches,
with ``validate=False`` when an input is batched and ``dispatch="dense"`` when anything reaching the MoE routers is.
Host-side only: one functorch query outside any transform, no per-layer checks, no device reads.
"""
from __future__ import annotations

import torch

from .config import Config
from .pytree import flatten_with_paths
from .vision import VISION_PARAMS

# torch 2.11-2.12 have no vmap batching rule for Tensor.view(dtype) (pytorch#180727, fixed in 2.13), which the
# release's exponent-bit quantisation (quant.pow2_ceil_scale) and the indexer's exact top-k use on every layer
VMAP_VIEW_DTYPE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def vmapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by an enclosing ``torch.func.vmap`` (under grad / jvp wrappers too)."""
    ft = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t):
        if ft.is_batchedtensor(t):
            return True
        t = ft.get_unwrapped(t)
    return False


def check_unsharded(params: dict) -> None:
    """Inside a torch.func transform (forward and the DSpark functions call it; outside one it returns at once):
    refuse a sharded tree by name. DTensor's from_local / to_local are autograd.Functions without functorch rules,
    and a transform's wrapper hides the DTensor from ``sharding``'s helpers, so the forward failed deep inside
    torch ("got mixed torch.Tensor and DTensor"). Host-only."""
    ft = torch._C._functorch
    if ft.maybe_current_level() is None:
        return
    from . import sharding
    for path, _, node in sharding.split_parts(params):
        if isinstance(node, list):        # the released list of experts is never split (a per-step walk saved)
            continue
        for leaf, t in (flatten_with_paths(node).items() if isinstance(node, dict) else (("", node),)):
            while isinstance(t, torch.Tensor) and ft.is_functorch_wrapped_tensor(t):
                t = ft.get_unwrapped(t)
            if sharding.is_sharded(t):
                raise NotImplementedError(
                    f"forward: torch.func transforms (grad, vjp, jvp, vmap) over a sharded tree are not supported: "
                    f"{path + ('.' + leaf if leaf else '')} is a DTensor shard (sharding.shard_params), and DTensor "
                    f"has no functorch rules; differentiate with torch.autograd (loss.backward()) or transform the "
                    f"plain tree")


def _tensors(x):
    """The tensors in nested lists, tuples and dicts (batch["images"])."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple, dict)):
        for e in (x.values() if isinstance(x, dict) else x):
            yield from _tensors(e)


def under_vmap() -> bool:
    """Whether a ``torch.func.vmap`` is active (one functorch query outside any transform)."""
    ft = torch._C._functorch
    if ft.maybe_current_level() is None:                    # no torch.func transform at all: the common case
        return False
    return any(i.key() == ft.TransformType.Vmap for i in ft.get_interpreter_stack() or ())


# read only after the last MoE router (the last layer's experts and its ffn hyper-connection), by the head, or
# (without images, the stages always) not at all: vmapped, they leave routing and the state's histories unbatched
_AFTER_ROUTERS = ("head.", "norm.", "mtp.")


def check_vmap(params: dict, batch: dict, cfg: Config, state, *, validate: bool, dispatch: str,
               impl: str | None) -> str:
    """Under ``torch.func.vmap`` (forward calls it only there), refuse by name the setups forward cannot run
    (forward's docstring, "Under torch.func"), which failed deep inside torch ("calling .item()", "Cannot access
    data pointer of Tensor that doesn't have storage", "inplace arithmetic ... vmapped over", "You tried to vmap
    over _HcSplitSinkhorn"); returns the kernel impl to run: "torch" (functorch refuses the TileLang ops'
    autograd.Functions under vmap, batched or not, so impl="auto" cannot fall back op by op). Host-only."""
    from . import kernels
    chosen = kernels.default_impl() if impl is None else impl
    if chosen not in kernels.IMPLS:
        return impl                     # the kernels' dispatcher names it
    if chosen == "tilelang":
        raise ValueError("forward: impl='tilelang' cannot run under torch.func.vmap (the TileLang kernels take no "
                         "batched tensors and functorch refuses their autograd.Functions); pass impl='auto' or "
                         "'torch', which run the torch reference under vmap")
    inputs = [k for k in ("input_ids", "token_types", "positions")
              if isinstance(batch.get(k), torch.Tensor) and vmapped(batch[k])]
    if "positions" in inputs:
        raise NotImplementedError(
            "forward: packed 'positions' batched by torch.func.vmap are not supported (the packed-sample bookkeeping "
            "and the compressor read their values); vmap over rows without positions, pass positions every example "
            "shares unbatched (in_dims=None), or run the packed batch without vmap")
    images = batch.get("images")
    rows = images if isinstance(images, (list, tuple)) else [images]
    an_image = any(e is not None and not (isinstance(e, (list, tuple)) and not e) for e in rows)
    if images is not None and ("token_types" in inputs or inputs and an_image):
        raise NotImplementedError(
            f"forward: a batch with images cannot have {inputs[0]} batched by torch.func.vmap (the image spans are "
            f"read from the token rows' values); vmap over the images' patches or the params with the token rows "
            f"unbatched, or run the rows as one batch without vmap")
    what = inputs[0] if inputs else None
    if what is None and images is not None and any(vmapped(t) for t in _tensors(images)):
        what = "the images' patches"
    if what is None and isinstance(params, dict):
        last = f"layers.{cfg.layer_ids[-1]}."
        skip = _AFTER_ROUTERS + (last + "ffn.experts.", last + "ffn.shared_experts.", last + "hc_ffn_") \
            + (VISION_PARAMS if images is None else ())      # (their top-level keys: path prefixes)
        what = next((f"params {k}" for k, t in flatten_with_paths(params).items()
                     if isinstance(t, torch.Tensor) and not k.startswith(skip) and vmapped(t)), None)
    if what is None:                    # vmap over something else (the head, a tangent, a closed-over tensor)
        return "torch"
    if state is not None:
        raise NotImplementedError(
            f"forward: a DecodeState cannot be used under torch.func.vmap with {what} batched (forward appends to "
            f"the state's preallocated histories in place); vmap a stateless forward over the whole sequence, or "
            f"put the examples in the state's own batch dimension (fd.init_state(cfg, batch_size, ...)) without vmap")
    fixes = []
    if validate and inputs:
        fixes.append("validate=False (the input checks read the token ids' values: run them once outside vmap)")
    if dispatch != "dense":
        fixes.append(f"dispatch='dense' (dispatch={dispatch!r} groups the tokens by expert, in groups of "
                     f"data-dependent sizes; 'dense' runs every expert on every token: tiny configs)")
    if fixes:
        raise ValueError(f"forward under torch.func.vmap with {what} batched: pass " + " and ".join(fixes))
    if not VMAP_VIEW_DTYPE:
        raise NotImplementedError(
            f"forward under torch.func.vmap with {what} batched needs torch >= 2.13: torch {torch.__version__} has no "
            f"vmap rule for Tensor.view(dtype) (pytorch#180727), which the exponent-bit quantisation uses in every "
            f"layer; run the examples as one batch, or upgrade torch")
    return "torch"
