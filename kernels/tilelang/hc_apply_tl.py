"""The hyper-connection applications (SPEC §2), fused: ``hc_pre`` (collapse the streams) and ``hc_post`` (expand the
sublayer output back into them), TileLang/Hopper.

Why: in torch each is a chain of fp32 temporaries. ``hc_post`` materialises ``comb[j, k] * res_j`` as
[tokens, hc, hc, dim] fp32 (1.3 GB at 4096 tokens of the release's dim 5120) before summing it, so it moves many
times the bytes it must (read y and res in bf16, write out in bf16). Here a CTA takes up to 1024 columns of one
token: its hc streams are read once (16-byte loads into shared memory when ``staged``), each output written once.

Numerics: the reference's exactly. Every product and sum is a separately rounded fp32 ``__fmul_rn`` /
``__fadd_rn`` (no FMA contraction), the sums over streams in index order as ``invariant.ordered_sum``, then one
round to bf16: the bits of ``reference.hc_pre`` / ``reference.hc_post`` on the GPU, which tests/test_gpu_hc.py
asserts (H100 run 130: 0 differing values at every tested shape, 4096 x 4 x 5120 and 70000 tokens included).

The backwards are kernels too (``hc_pre_bwd_kernel`` / ``hc_post_bwd_kernel``: one token a CTA, its sums over dim in
registers). dh is one rounded product (autograd's bits); dy, dres are four-term fp32 sums; dpre, dpost, dcomb are
fp32 sums over dim in this kernel's order, within 1e-5 of the sum of |terms| of ``reference.hc_pre_bwd`` /
``hc_post_bwd`` (the torch maths, kept as the fallback and under ``FUSED_BWD = False``). They are first-order.

Measured (H100 run 131, 4096 tokens, hc 4, dim 5120; BENCHMARKS.md): forwards 0.077 / 0.134 ms (2.7 / 2.8 TB/s of
the bytes that must move) against torch's 0.86 / 3.19; backwards 0.14 / 0.24 ms against 0.90 / 2.02; both ops
forward and backward 0.87 ms against 11.0 ms for autograd through the torch spelling.
"""
import functools
import os

import torch
import tilelang.language as T

from .. import reference
from ._common import Unsupported, compile_kernel, plain

BF16, F32 = "bfloat16", "float32"
THREADS = 128
STAGED = True                   # the kernels' default layout (bench --only hcapply compares both)
FUSED_BWD = True                # the backwards as kernels; False: reference.hc_pre_bwd / hc_post_bwd (torch)
# On by default since H100 runs 130-131 (the reference's bits at every tested shape; forward + backward 12x faster
# than torch at the release shape). DSV41_HC_APPLY=torch turns them off: the wrappers then raise Unsupported, so
# impl="auto" runs the torch spelling.
MODE = os.environ.get("DSV41_HC_APPLY", "tilelang")
ENABLED = MODE == "tilelang"


def _cols(dim: int, cap: int = 1024) -> int:
    """Columns a CTA covers at a time (of one token): the largest of cap, cap / 2, ..., 128 dividing ``dim``
    (1024 for the forwards; the backwards, whose sums over dim stay in registers, cap it lower)."""
    c = cap
    while c >= 128:
        if dim % c == 0:
            return c
        c //= 2
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


@functools.lru_cache(maxsize=None)
def hc_pre_bwd_kernel(hc: int, dim: int):
    """h [N, hc, dim] bf16, pre [N, hc] fp32, dx [N, dim] bf16 -> dh [N, hc, dim] bf16, dpre [N, hc] fp32:
    dh_j = bf16(pre_j dx) (one rounded product: autograd's bits) and dpre_j = sum_d dx h_j (fp32, this kernel's
    summation order). A CTA (128 threads) takes one token and walks its dim in CB-column steps, each a 16-byte copy
    into shared memory; the dpre partial sums stay in registers until one reduction at the end. A plain loop, not
    T.Pipelined: that would make a warp-specialized 256-thread CTA holding a whole SM's registers, one token an
    SM at a time; small CTAs let several tokens' copies be in flight on an SM."""
    N = T.dynamic("N")
    CB = _cols(dim, 512)

    @T.prim_func
    def hc_pre_bwd(H: T.Tensor([N, hc, dim], BF16), Pre: T.Tensor([N, hc], F32), DX: T.Tensor([N, dim], BF16),
                   DH: T.Tensor([N, hc, dim], BF16), DPre: T.Tensor([N, hc], F32)):
        with T.Kernel(N, threads=THREADS) as n:
            ps = T.alloc_shared([hc], F32)
            hs = T.alloc_shared([hc, CB], BF16)
            gs = T.alloc_shared([CB], BF16)
            dhs = T.alloc_shared([hc, CB], BF16)
            acc = T.alloc_fragment([hc, CB], F32)
            red = T.alloc_fragment([hc], F32)
            T.copy(Pre[n, :], ps)
            T.clear(acc)
            for b in T.serial(dim // CB):
                T.copy(H[n, :, b * CB:(b + 1) * CB], hs)
                T.copy(DX[n, b * CB:(b + 1) * CB], gs)
                for j, c in T.Parallel(hc, CB):
                    dhs[j, c] = T.cast(T.ieee_mul(ps[j], T.cast(gs[c], F32)), BF16)
                    acc[j, c] += T.cast(gs[c], F32) * T.cast(hs[j, c], F32)
                T.copy(dhs, DH[n, :, b * CB:(b + 1) * CB])
            T.reduce_sum(acc, red, dim=1)
            T.copy(red, DPre[n, :])

    # the reduction's workspace may share ps's shared memory: ps is written only before the loop, never after
    return compile_kernel(hc_pre_bwd, workspace_alias_ok=True)


@functools.lru_cache(maxsize=None)
def hc_post_bwd_kernel(hc: int, dim: int):
    """y [N, dim], res [N, hc, dim] bf16, post [N, hc], comb [N, hc, hc] fp32, dout [N, hc, dim] bf16 ->
    dy [N, dim] bf16 = sum_k post_k dout_k, dres [N, hc, dim] bf16 = sum_k comb[j, k] dout_k (fp32 sums over k in
    index order, one round), dpost [N, hc] = sum_d dout_k y and dcomb [N, hc * hc] = sum_d res_j dout_k (fp32, this
    kernel's summation order). One token a CTA, as hc_pre_bwd_kernel; its hc + hc^2 partial sums over dim stay in
    registers (CB 256: 40 a thread at hc 4) until two reductions at the end."""
    N = T.dynamic("N")
    CB = _cols(dim, 256)

    def over_k(w, j, gsm, c):
        """((w(j, 0) g_0 + w(j, 1) g_1) + ...), g_k = dout[k, c] in fp32 (unrolled here, as _ordered_sum)."""
        acc = w(j, 0) * T.cast(gsm[0, c], F32)
        for k in range(1, hc):
            acc = acc + w(j, k) * T.cast(gsm[k, c], F32)
        return acc

    @T.prim_func
    def hc_post_bwd(Y: T.Tensor([N, dim], BF16), Res: T.Tensor([N, hc, dim], BF16), Post: T.Tensor([N, hc], F32),
                    Comb: T.Tensor([N, hc, hc], F32), DOut: T.Tensor([N, hc, dim], BF16),
                    DY: T.Tensor([N, dim], BF16), DRes: T.Tensor([N, hc, dim], BF16),
                    DPost: T.Tensor([N, hc], F32), DComb: T.Tensor([N, hc * hc], F32)):
        with T.Kernel(N, threads=THREADS) as n:
            ps = T.alloc_shared([hc], F32)
            cs = T.alloc_shared([hc, hc], F32)
            ys = T.alloc_shared([CB], BF16)
            rs = T.alloc_shared([hc, CB], BF16)
            gs = T.alloc_shared([hc, CB], BF16)
            dys = T.alloc_shared([CB], BF16)
            drs = T.alloc_shared([hc, CB], BF16)
            accp = T.alloc_fragment([hc, CB], F32)
            accc = T.alloc_fragment([hc * hc, CB], F32)
            redp = T.alloc_fragment([hc], F32)
            redc = T.alloc_fragment([hc * hc], F32)
            T.copy(Post[n, :], ps)
            T.copy(Comb[n, :, :], cs)
            T.clear(accp)
            T.clear(accc)
            for b in T.serial(dim // CB):
                T.copy(Y[n, b * CB:(b + 1) * CB], ys)
                T.copy(Res[n, :, b * CB:(b + 1) * CB], rs)
                T.copy(DOut[n, :, b * CB:(b + 1) * CB], gs)
                for c in T.Parallel(CB):
                    dys[c] = T.cast(over_k(lambda j, k: ps[k], 0, gs, c), BF16)
                for j, c in T.Parallel(hc, CB):
                    drs[j, c] = T.cast(over_k(lambda j, k: cs[j, k], j, gs, c), BF16)
                for k, c in T.Parallel(hc, CB):
                    accp[k, c] += T.cast(gs[k, c], F32) * T.cast(ys[c], F32)
                for jk, c in T.Parallel(hc * hc, CB):
                    accc[jk, c] += T.cast(rs[jk // hc, c], F32) * T.cast(gs[jk % hc, c], F32)
                T.copy(dys, DY[n, b * CB:(b + 1) * CB])
                T.copy(drs, DRes[n, :, b * CB:(b + 1) * CB])
            T.reduce_sum(accp, redp, dim=1)
            T.sync_threads()            # the second reduction's workspace may be the first's
            T.reduce_sum(accc, redc, dim=1)
            T.copy(redp, DPost[n, :])
            T.copy(redc, DComb[n, :])

    # the workspaces may share the small buffers' shared memory (ps, cs), which are written only before the loop
    return compile_kernel(hc_post_bwd, workspace_alias_ok=True)


def _run_bwd_pre(h, pre, dx):
    n, hc, dim = h.shape[:-2].numel(), h.shape[-2], h.shape[-1]
    dh, dpre = torch.empty_like(h), torch.empty_like(pre)          # (pre is fp32: hc_pre's check)
    hc_pre_bwd_kernel(int(hc), int(dim))(h.reshape(n, hc, dim), pre.reshape(n, hc).contiguous(),
                                         dx.reshape(n, dim).contiguous(), dh.view(n, hc, dim), dpre.view(n, hc))
    return dh, dpre


def _run_bwd_post(y, res, post, comb, dout):
    n, hc, dim = res.shape[:-2].numel(), res.shape[-2], res.shape[-1]
    dy, dres = torch.empty_like(y), torch.empty_like(res)
    dpost, dcomb = torch.empty_like(post), torch.empty_like(comb)  # (fp32: hc_post's check)
    hc_post_bwd_kernel(int(hc), int(dim))(y.reshape(n, dim), res.reshape(n, hc, dim),
                                          post.reshape(n, hc).contiguous(), comb.reshape(n, hc, hc).contiguous(),
                                          dout.reshape(n, hc, dim).contiguous(), dy.view(n, dim),
                                          dres.view(n, hc, dim), dpost.view(n, hc), dcomb.view(n, hc * hc))
    return dy, dres, dpost, dcomb


def _first_order(name: str, run):
    """``run`` as an autograd.Function of its own, so that under torch.func.grad the kernel sees plain tensors
    (functorch unwraps an autograd.Function's forward inputs, not its backward's: hc_sinkhorn_tl._HcBwdKernel).
    First-order only: a gradient of it raises (FUSED_BWD = False gives the torch backward, which differentiates)."""
    def backward(ctx, *grads):
        raise NotImplementedError(f"{name}: the fused hc backward kernels are first-order only; set "
                                  "functional_dsv41.kernels.tilelang.hc_apply_tl.FUSED_BWD = False for double backward")
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(run),
                                                   "setup_context": staticmethod(lambda ctx, inputs, output: None),
                                                   "backward": staticmethod(backward)})


_HcPreBwd = _first_order("_HcPreBwd", _run_bwd_pre)
_HcPostBwd = _first_order("_HcPostBwd", _run_bwd_post)


def _bwd_pre(h, pre, dx):
    """(dh, dpre): the kernel where it covers (bf16 dx, some tokens; the forward kernel already asked the rest),
    else reference.hc_pre_bwd."""
    if not (FUSED_BWD and h.shape[:-2].numel() and dx.dtype == torch.bfloat16):
        return reference.hc_pre_bwd(h, pre, dx)
    return _HcPreBwd.apply(h, pre, dx)


def _bwd_post(y, res, post, comb, dout):
    """(dy, dres, dpost, dcomb): the kernel where it covers (as _bwd_pre: bf16 dout, some tokens), else
    reference.hc_post_bwd."""
    if not (FUSED_BWD and res.shape[:-2].numel() and dout.dtype == torch.bfloat16):
        return reference.hc_post_bwd(y, res, post, comb, dout)
    return _HcPostBwd.apply(y, res, post, comb, dout)


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


_HcPre = _fused("_HcPre", _launch_pre, _bwd_pre)
_HcPost = _fused("_HcPost", _launch_post, _bwd_post)


def _check_enabled(op: str) -> None:
    if MODE not in ("tilelang", "torch"):
        raise ValueError(f"DSV41_HC_APPLY must be 'tilelang' (the default) or 'torch', got {MODE!r}")
    if not ENABLED:
        raise Unsupported(f"{op}: the fused kernel is turned off (DSV41_HC_APPLY={MODE}; unset it to turn it on)")


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.hc_pre``; Unsupported (-> torch under impl="auto") unless h is bf16 and
    contiguous, pre fp32 and dim a multiple of 128."""
    reference.check_hc_pre(h, pre)
    _check_enabled("hc_pre")
    for t in (h, pre):              # under vmap: Unsupported, so impl="auto" runs the torch spelling (which vmaps)
        plain(t)
    if h.dtype != torch.bfloat16 or pre.dtype != torch.float32 or not h.is_contiguous():
        raise Unsupported("hc_pre: the kernel takes contiguous bf16 streams and fp32 weights")
    _cols(h.shape[-1])
    return _HcPre.apply(h, pre)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.hc_post``; Unsupported unless y and res are contiguous bf16, post and comb
    fp32 and dim a multiple of 128."""
    reference.check_hc_post(y, res, post, comb)
    _check_enabled("hc_post")
    for t in (y, res, post, comb):
        plain(t)
    if (y.dtype != torch.bfloat16 or res.dtype != torch.bfloat16 or post.dtype != torch.float32
            or comb.dtype != torch.float32 or not (y.is_contiguous() and res.is_contiguous())):
        raise Unsupported("hc_post: the kernel takes contiguous bf16 y, res and fp32 post, comb")
    _cols(res.shape[-1])
    return _HcPost.apply(y, res, post, comb)
