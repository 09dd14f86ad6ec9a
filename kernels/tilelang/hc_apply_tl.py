"""The hyper-connection applications (SPEC §2), fused: ``hc_pre`` (collapse the streams) and ``hc_post`` (expand the
sublayer output back into them), TileLang/Hopper.

Why: in torch each is a chain of fp32 temporaries. ``hc_post`` materialises ``comb[j, k] * res_j`` as
[tokens, hc, hc, dim] fp32 (1.3 GB at 4096 tokens of the release's dim 5120) before summing it, so it moves many
times the bytes it must (read y and res in bf16, write out in bf16). Here a CTA takes up to 1024 columns of one
token: its hc streams are read once (16-byte loads into shared memory when ``staged``), each output written once.

Numerics: the reference's exactly. Every product and sum is a separately rounded fp32 ``__fmul_rn`` /
``__fadd_rn`` (no FMA contraction), the sums over streams in index order as ``invariant.ordered_sum``, then one
round to bf16: by construction the bits of ``reference.hc_pre`` / ``reference.hc_post`` on the GPU, which
tests/test_gpu_hc.py asserts (not run yet: see ``ENABLED``). The backwards are torch
(``reference.hc_pre_bwd`` / ``hc_post_bwd``: the same maths as autograd through the reference, with batched
matmuls for the sums over dim instead of [tokens, hc, hc, dim] temporaries).
"""
import functools
import os

import torch
import tilelang.language as T

from .. import reference
from ._common import Unsupported, compile_kernel

BF16, F32 = "bfloat16", "float32"
THREADS = 128
STAGED = True                   # the kernels' default layout (bench --only hcapply compares both)
# Opt-in until a GPU run has checked them (written 2026-12-06 without a device: tests/test_gpu_hc.py -k hc_pre and
# bench --only hcapply have not run). Off, the wrappers raise Unsupported, so impl="auto" keeps the torch spelling.
ENABLED = os.environ.get("DSV41_HC_APPLY", "torch") == "tilelang"


def _cols(dim: int) -> int:
    """Columns a CTA covers (of one token): the largest of 1024, 512, 256, 128 dividing ``dim``."""
    for c in (1024, 512, 256, 128):
        if dim % c == 0:
            return c
    raise Unsupported(f"hc_pre / hc_post: dim {dim} is not a multiple of 128")


def _ordered_sum(w, S, before, after, hc: int, k=None):
    """The expression ((w_0 s_0 + w_1 s_1) + ...) + w_{hc-1} s_{hc-1}, s_j = S[*before, j, *after], each product and
    sum a separately rounded fp32 op; w[j] (hc_pre) or w[j * hc + k] (hc_post's column k of comb). Plain Python,
    called from the kernels' bodies: the unrolling happens here, not as a TIR loop (whose body could not carry the
    sum)."""
    def term(j):
        return T.ieee_mul(w[j] if k is None else w[j * hc + k], T.cast(S[(*before, j, *after)], F32))
    acc = term(0)
    for j in range(1, hc):
        acc = T.ieee_add(acc, term(j))
    return acc


@functools.lru_cache(maxsize=None)
def hc_pre_kernel(hc: int, dim: int, staged: bool = True):
    """h [N, hc, dim] bf16, pre [N, hc] fp32 -> x [N, dim] bf16: x = bf16(((pre_0 h_0 + pre_1 h_1) + ...) ).
    ``staged``: the CTA's [hc, C] slice is copied into shared memory (16-byte accesses) and x out of registers;
    else each value is read and written where it is used (2-byte accesses)."""
    N = T.dynamic("N")
    C = _cols(dim)

    @T.prim_func
    def hc_pre(H: T.Tensor([N, hc, dim], BF16), Pre: T.Tensor([N, hc], F32), X: T.Tensor([N, dim], BF16)):
        with T.Kernel(N, dim // C, threads=THREADS) as (n, bc):  # tokens on x: y stops at 65535
            p = T.alloc_local([hc], F32)
            for j in T.unroll(hc):
                p[j] = Pre[n, j]
            if staged:
                hf = T.alloc_shared([hc, C], BF16)        # (a fragment's elements must be read at the loop's
                xf = T.alloc_fragment([C], BF16)          # own indices)
                T.copy(H[n, :, bc * C:(bc + 1) * C], hf)
                for c in T.Parallel(C):
                    xf[c] = T.cast(_ordered_sum(p, hf, (), (c,), hc), BF16)
                T.copy(xf, X[n, bc * C:(bc + 1) * C])
            else:
                for c in T.Parallel(C):
                    col = bc * C + c
                    X[n, col] = T.cast(_ordered_sum(p, H, (n,), (col,), hc), BF16)

    return compile_kernel(hc_pre)


@functools.lru_cache(maxsize=None)
def hc_post_kernel(hc: int, dim: int, staged: bool = True):
    """y [N, dim] bf16, res [N, hc, dim] bf16, post [N, hc], comb [N, hc, hc] fp32 -> out [N, hc, dim] bf16:
    out_k = bf16(post_k y + ((comb[0, k] res_0 + comb[1, k] res_1) + ...)). ``staged``: as hc_pre_kernel's."""
    N = T.dynamic("N")
    C = _cols(dim)

    @T.prim_func
    def hc_post(Y: T.Tensor([N, dim], BF16), Res: T.Tensor([N, hc, dim], BF16), Post: T.Tensor([N, hc], F32),
                Comb: T.Tensor([N, hc, hc], F32), Out: T.Tensor([N, hc, dim], BF16)):
        with T.Kernel(N, dim // C, threads=THREADS) as (n, bc):  # tokens on x: y stops at 65535
            p = T.alloc_local([hc], F32)
            cm = T.alloc_local([hc * hc], F32)
            for j in T.unroll(hc):
                p[j] = Post[n, j]
                for k in T.unroll(hc):
                    cm[j * hc + k] = Comb[n, j, k]
            if staged:
                yf = T.alloc_shared([C], BF16)
                rf = T.alloc_shared([hc, C], BF16)
                of = T.alloc_shared([hc, C], BF16)
                T.copy(Y[n, bc * C:(bc + 1) * C], yf)
                T.copy(Res[n, :, bc * C:(bc + 1) * C], rf)
                for k in T.unroll(hc):
                    for c in T.Parallel(C):
                        of[k, c] = T.cast(T.ieee_add(T.ieee_mul(p[k], T.cast(yf[c], F32)),
                                                     _ordered_sum(cm, rf, (), (c,), hc, k)), BF16)
                T.copy(of, Out[n, :, bc * C:(bc + 1) * C])
            else:
                for c in T.Parallel(C):
                    col = bc * C + c
                    y = T.cast(Y[n, col], F32)
                    for k in T.unroll(hc):
                        Out[n, k, col] = T.cast(T.ieee_add(T.ieee_mul(p[k], y),
                                                           _ordered_sum(cm, Res, (n,), (col,), hc, k)), BF16)

    return compile_kernel(hc_post)


def _launch_pre(h, pre):
    n, hc, dim = h.shape[:-2].numel(), h.shape[-2], h.shape[-1]
    x = h.new_empty(*h.shape[:-2], dim)
    if n:
        hc_pre_kernel(int(hc), int(dim), STAGED)(h.reshape(n, hc, dim), pre.reshape(n, hc).contiguous(),
                                                 x.view(n, dim))
    return x


def _launch_post(y, res, post, comb):
    n, hc, dim = res.shape[:-2].numel(), res.shape[-2], res.shape[-1]
    out = res.new_empty(res.shape)
    if n:
        hc_post_kernel(int(hc), int(dim), STAGED)(y.reshape(n, dim), res.reshape(n, hc, dim),
                                                  post.reshape(n, hc).contiguous(),
                                                  comb.reshape(n, hc, hc).contiguous(), out.view(n, hc, dim))
    return out


def _fused(name: str, launch, bwd):
    """An autograd.Function (setup_context form, for torch.func.grad too): the kernel ``launch`` forward, the torch
    ``bwd(*inputs, grad)`` backward."""
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        return bwd(*ctx.saved_tensors, grad)
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(launch),
                                                   "setup_context": staticmethod(setup_context),
                                                   "backward": staticmethod(backward)})


_HcPre = _fused("_HcPre", _launch_pre, reference.hc_pre_bwd)
_HcPost = _fused("_HcPost", _launch_post, reference.hc_post_bwd)


def _check_enabled(op: str) -> None:
    if not ENABLED:
        raise Unsupported(f"{op}: the fused kernel is opt-in until it has run on a GPU (DSV41_HC_APPLY=tilelang)")


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.hc_pre``; Unsupported (-> torch under impl="auto") unless h is bf16 and
    contiguous, pre fp32 and dim a multiple of 128."""
    reference.check_hc_pre(h, pre)
    _check_enabled("hc_pre")
    if h.dtype != torch.bfloat16 or pre.dtype != torch.float32 or not h.is_contiguous():
        raise Unsupported("hc_pre: the kernel takes contiguous bf16 streams and fp32 weights")
    _cols(h.shape[-1])
    return _HcPre.apply(h, pre)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.hc_post``; Unsupported unless y and res are contiguous bf16, post and comb
    fp32 and dim a multiple of 128."""
    reference.check_hc_post(y, res, post, comb)
    _check_enabled("hc_post")
    if (y.dtype != torch.bfloat16 or res.dtype != torch.bfloat16 or post.dtype != torch.float32
            or comb.dtype != torch.float32 or not (y.is_contiguous() and res.is_contiguous())):
        raise Unsupported("hc_post: the kernel takes contiguous bf16 y, res and fp32 post, comb")
    _cols(res.shape[-1])
    return _HcPost.apply(y, res, post, comb)
