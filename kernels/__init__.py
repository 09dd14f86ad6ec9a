"""The release's kernels behind one API, with an implementation switch (SPEC §10; DESIGN convention 6).

    from functional_dsv41 import kernels
    o = kernels.sparse_attn(q, kv, sink, idx, scale, impl="auto")

``impl``: ``"torch"`` (the pure-torch executable spec, ``kernels/reference.py``, runs everywhere),
``"tilelang"`` (GPU kernels in ``kernels/tilelang/``; an error where they cannot run) or ``"auto"``
(TileLang on a CUDA tensor where TileLang imports and implements the op, torch otherwise). The
default for a process can be set with ``DSV41_KERNELS=torch|tilelang|auto``.

Model code calls these names only; it never imports an implementation directly.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
from typing import Callable

from . import reference

class Unsupported(ValueError):
    """Raised by a TileLang op, before it launches anything, for inputs it does not implement (e.g. a head
    count or dtype its tiles do not cover, fp8_gemm's block_size other than 32) although the op is defined for
    them. ``impl="auto"`` then runs the torch reference instead; ``impl="tilelang"`` lets it propagate. Invalid
    input (what the torch op refuses too) raises a plain ValueError under every impl."""


OPS = ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "fp4_gemm_grouped", "sparse_attn", "hc_split_sinkhorn",
       "hc_pre", "hc_post", "index_scores", "index_topk", "index_candidates")
IMPLS = ("auto", "torch", "tilelang")


@functools.lru_cache(maxsize=1)
def tilelang_status() -> tuple[bool, str]:
    """Capability probe: (usable, reason). Usable needs CUDA and an importable ``tilelang``."""
    try:
        import torch
        if not torch.cuda.is_available():
            return False, "no CUDA device"
    except Exception as e:  # pragma: no cover
        return False, f"torch: {e}"
    try:
        importlib.import_module("tilelang")
    except Exception as e:
        return False, f"tilelang does not import: {type(e).__name__}: {e}"
    return True, "ok"


def tilelang_available() -> bool:
    return tilelang_status()[0]


@functools.lru_cache(maxsize=None)
def _tilelang_op(name: str) -> Callable | None:
    """The TileLang implementation of op ``name``, or None if it has none (yet)."""
    if not tilelang_available():
        return None
    try:
        mod = importlib.import_module(f"{__name__}.tilelang")
    except ImportError:
        return None
    return getattr(mod, name, None)


def default_impl() -> str:
    impl = os.environ.get("DSV41_KERNELS", "auto")
    if impl not in IMPLS:
        raise ValueError(f"DSV41_KERNELS={impl!r}: expected one of {IMPLS}")
    return impl


def _impl(impl, name: str | None = None) -> str:
    """``impl`` itself (None: ``default_impl()``), refused unless one of IMPLS: a falsy value ("", 0) is no
    request for the default."""
    impl = default_impl() if impl is None else impl
    if not isinstance(impl, str) or impl not in IMPLS:
        op = f"{name}: " if name else ""
        raise ValueError(f"{op}impl must be one of {IMPLS} (or None for the default, DSV41_KERNELS), got {impl!r}")
    return impl


def resolve(name: str, impl: str | None = None, *, on_cuda: bool = True) -> Callable:
    """The function that runs op ``name`` under ``impl``."""
    if name not in OPS:
        raise ValueError(f"unknown kernel {name!r}; known: {OPS}")
    impl = _impl(impl, name)
    if impl == "torch":
        return getattr(reference, name)
    if impl == "tilelang":
        ok, why = tilelang_status()
        if not ok:
            raise RuntimeError(f"impl='tilelang' for {name}: TileLang cannot run here ({why})")
        fn = _tilelang_op(name)
        if fn is None:
            raise NotImplementedError(f"no TileLang implementation of {name}")
        return fn
    fn = _tilelang_op(name) if on_cuda else None
    return fn or getattr(reference, name)


def _first_tensor_is_cuda(args, kwargs=None) -> bool:
    """Whether the op's first tensor argument (positional or, failing that, keyword) lives on a GPU."""
    for a in (*args, *(kwargs or {}).values()):
        if hasattr(a, "is_cuda"):
            return bool(a.is_cuda)
    return False


def _dispatcher(name: str):
    ref = getattr(reference, name)
    sig = inspect.signature(ref)

    @functools.wraps(ref)
    def op(*args, impl: str | None = None, **kwargs):
        impl = _impl(impl, name)
        fn = resolve(name, impl, on_cuda=_first_tensor_is_cuda(args, kwargs))
        try:
            return fn(*args, **kwargs)
        except Unsupported:
            if impl != "auto":
                raise
            return ref(*args, **kwargs)
    op.__signature__ = sig.replace(parameters=[*sig.parameters.values(), inspect.Parameter(
        "impl", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None")])
    return op


act_quant = _dispatcher("act_quant")
fp4_act_quant = _dispatcher("fp4_act_quant")
fp8_gemm = _dispatcher("fp8_gemm")
fp4_gemm = _dispatcher("fp4_gemm")
fp4_gemm_grouped = _dispatcher("fp4_gemm_grouped")
sparse_attn = _dispatcher("sparse_attn")
hc_split_sinkhorn = _dispatcher("hc_split_sinkhorn")
hc_pre = _dispatcher("hc_pre")
hc_post = _dispatcher("hc_post")
index_scores = _dispatcher("index_scores")
index_topk = _dispatcher("index_topk")
index_candidates = _dispatcher("index_candidates")
