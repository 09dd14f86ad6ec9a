"""mHC mix split + Sinkhorn-Knopp (SPEC §2, §10.6), TileLang forward, torch backward.

Forward (one thread per token, everything in registers): ``pre = sigmoid(m[:hc]*s0 + b[:hc]) + eps``,
``post = 2*sigmoid(m[hc:2hc]*s1 + b[hc:2hc])``, ``comb = softmax(m[2hc:]*s2 + b[2hc:]) + eps`` per row,
a column normalisation, then ``iters - 1`` (row, column) normalisations ``c / (sum + eps)``; sums are
sequential adds in index order as in ``reference.hc_split_sinkhorn``, divisions IEEE (``T.ieee_fdiv``),
exp the fast-math one (matches the reference within ~1e-6 fp32).

Backward (``_HcSplitSinkhorn.backward``): recomputes the forward in torch keeping the ``2*iters``
normalised matrices ([N, hc, hc] each, 2.6 MB per 4096 tokens), then runs the chain rule in reverse by
hand: for ``y = x / (sum_d x + eps)``, ``dx = (dy - sum_d(dy * y)) / (sum_d x + eps)``; softmax
``da = p * (dp - sum(dp * p))``; sigmoid ``da = dy * s * (1 - s)``. Plain tensor maths, no autograd
inside, so it works under ``torch.autograd`` and ``torch.func.grad``/``vjp`` alike.
"""
import functools

import torch
import tilelang.language as T

from ._common import compile_kernel

F32 = "float32"


@functools.lru_cache(maxsize=None)
def hc_split_sinkhorn_kernel(hc: int, iters: int, eps: float, threads: int = 128):
    """mixes [N, (2+hc)*hc] fp32, scale [3], base [(2+hc)*hc] -> pre [N, hc], post [N, hc], comb [N, hc*hc]."""
    N = T.dynamic("N")
    W = (2 + hc) * hc
    HH = hc * hc
    C0 = 2 * hc

    @T.prim_func
    def hc_split_sinkhorn(
        Mx: T.Tensor([N, W], F32),
        Sc: T.Tensor([3], F32),
        Bs: T.Tensor([W], F32),
        Pre: T.Tensor([N, hc], F32),
        Post: T.Tensor([N, hc], F32),
        Comb: T.Tensor([N, HH], F32),
    ):
        with T.Kernel(T.ceildiv(N, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            m = T.alloc_local([W], F32)
            c = T.alloc_local([HH], F32)
            acc = T.alloc_local([1], F32)
            n = bx * threads + tx
            if n < N:
                for k in T.unroll(W):
                    m[k] = Mx[n, k]
                for k in T.unroll(hc):
                    Pre[n, k] = T.ieee_fdiv(T.float32(1.0), T.float32(1.0) + T.exp(-(m[k] * Sc[0] + Bs[k]))) \
                        + T.float32(eps)
                    Post[n, k] = T.float32(2.0) * T.ieee_fdiv(
                        T.float32(1.0), T.float32(1.0) + T.exp(-(m[hc + k] * Sc[1] + Bs[hc + k])))
                for k in T.unroll(HH):
                    c[k] = m[C0 + k] * Sc[2] + Bs[C0 + k]
                # softmax over each row (max-shifted exp, one division) + eps
                for i in T.unroll(hc):
                    acc[0] = c[i * hc]
                    for j in T.unroll(1, hc):
                        acc[0] = T.max(acc[0], c[i * hc + j])
                    for j in T.unroll(hc):
                        c[i * hc + j] = T.exp(c[i * hc + j] - acc[0])
                    acc[0] = c[i * hc]
                    for j in T.unroll(1, hc):
                        acc[0] = acc[0] + c[i * hc + j]
                    for j in T.unroll(hc):
                        c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0]) + T.float32(eps)
                # column normalisation, then (iters - 1) x (row, column)
                for j in T.unroll(hc):
                    acc[0] = c[j]
                    for i in T.unroll(1, hc):
                        acc[0] = acc[0] + c[i * hc + j]
                    for i in T.unroll(hc):
                        c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0] + T.float32(eps))
                for _ in T.serial(iters - 1):
                    for i in T.unroll(hc):
                        acc[0] = c[i * hc]
                        for j in T.unroll(1, hc):
                            acc[0] = acc[0] + c[i * hc + j]
                        for j in T.unroll(hc):
                            c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0] + T.float32(eps))
                    for j in T.unroll(hc):
                        acc[0] = c[j]
                        for i in T.unroll(1, hc):
                            acc[0] = acc[0] + c[i * hc + j]
                        for i in T.unroll(hc):
                            c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0] + T.float32(eps))
                for k in T.unroll(HH):
                    Comb[n, k] = c[k]

    return compile_kernel(hc_split_sinkhorn, out_idx=[3, 4, 5])


def _fwd(mixes, hc_scale, hc_base, hc, iters, eps):
    lead = mixes.shape[:-1]
    m = mixes.float().reshape(-1, mixes.shape[-1]).contiguous()
    if m.shape[0] == 0:
        z = m.new_zeros(*lead, hc)
        return z, z.clone(), m.new_zeros(*lead, hc, hc)
    k = hc_split_sinkhorn_kernel(int(hc), int(iters), float(eps))
    pre, post, comb = k(m, hc_scale.float().contiguous(), hc_base.float().contiguous())
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def _bwd(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, hc, iters, eps):
    """Gradients of (pre, post, comb) w.r.t. (mixes, hc_scale, hc_base), by recomputation (torch)."""
    W = mixes.shape[-1]
    m = mixes.float().reshape(-1, W)
    sc, bs = hc_scale.float(), hc_base.float()
    N = m.shape[0]
    g_pre = g_pre.float().reshape(N, hc)
    g_post = g_post.float().reshape(N, hc)
    g_comb = g_comb.float().reshape(N, hc, hc)

    m_pre, m_post, m_c = m[:, :hc], m[:, hc:2 * hc], m[:, 2 * hc:]
    s_pre = torch.sigmoid(m_pre * sc[0] + bs[:hc])
    s_post = torch.sigmoid(m_post * sc[1] + bs[hc:2 * hc])
    a_c = (m_c * sc[2] + bs[2 * hc:]).unflatten(-1, (hc, hc))
    p = torch.softmax(a_c, dim=-1)
    # forward recomputation, keeping each normalisation's output and denominator
    steps = []                                   # (dim, y, denom)
    x = p + eps
    dims = [-2] + [-1, -2] * (iters - 1)
    for d in dims:
        den = x.sum(d, keepdim=True) + eps
        x = x / den
        steps.append((d, x, den))
    g = g_comb
    for d, y, den in reversed(steps):
        g = (g - (g * y).sum(d, keepdim=True)) / den
    da_c = p * (g - (g * p).sum(-1, keepdim=True))
    da_pre = g_pre * s_pre * (1 - s_pre)
    da_post = g_post * 2 * s_post * (1 - s_post)
    da_c = da_c.flatten(-2)

    dm = torch.cat([da_pre * sc[0], da_post * sc[1], da_c * sc[2]], -1)
    dsc = torch.stack([(da_pre * m_pre).sum(), (da_post * m_post).sum(), (da_c * m_c).sum()])
    dbs = torch.cat([da_pre.sum(0), da_post.sum(0), da_c.sum(0)])
    return dm.reshape(mixes.shape).to(mixes.dtype), dsc.to(hc_scale.dtype), dbs.to(hc_base.dtype)


class _HcSplitSinkhorn(torch.autograd.Function):
    """TileLang forward; backward recomputes in torch (setup_context form, for torch.func transforms)."""

    @staticmethod
    def forward(mixes, hc_scale, hc_base, hc, iters, eps):
        return _fwd(mixes, hc_scale, hc_base, hc, iters, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        mixes, hc_scale, hc_base, hc, iters, eps = inputs
        ctx.save_for_backward(mixes, hc_scale, hc_base)
        ctx.cfg = (hc, iters, eps)

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        mixes, hc_scale, hc_base = ctx.saved_tensors
        dm, dsc, dbs = _bwd(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, *ctx.cfg)
        return dm, dsc, dbs, None, None, None


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6):
    """Same contract as ``reference.hc_split_sinkhorn``: (pre [.., hc], post [.., hc], comb [.., hc, hc]) fp32."""
    if mixes.shape[-1] != (2 + hc_mult) * hc_mult:
        raise ValueError(f"mixes last dim {mixes.shape[-1]} != (2 + {hc_mult}) * {hc_mult}")
    if sinkhorn_iters < 1:
        from .. import reference
        return reference.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)
    return _HcSplitSinkhorn.apply(mixes, hc_scale, hc_base, int(hc_mult), int(sinkhorn_iters), float(eps))
