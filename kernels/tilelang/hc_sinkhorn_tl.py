"""mHC mix split + Sinkhorn-Knopp (SPEC §2, §10.6), TileLang forward and backward.

Forward (one thread per token, everything in registers): ``pre = sigmoid(m[:hc]*s0 + b[:hc]) + eps``,
``post = 2*sigmoid(m[hc:2hc]*s1 + b[hc:2hc])``, ``comb = softmax(m[2hc:]*s2 + b[2hc:]) + eps`` per row,
a column normalisation, then ``iters - 1`` (row, column) normalisations ``c / (sum + eps)``; sums are
sequential adds in index order as in ``reference.hc_split_sinkhorn``, divisions IEEE (``T.ieee_fdiv``;
``div="rcp"/"approx"``: one IEEE / MUFU reciprocal per sum and multiplies), exp the fast-math one
(matches the reference within ~1e-6 fp32).

Backward, two implementations (``bwd=`` / ``DSV41_HC_BWD``; "torch" stays the default until measured):
- "torch" (``_bwd``): recomputes the forward in torch keeping the ``2*iters`` normalised matrices
  ([N, hc, hc] each, 2.6 MB per 4096 tokens), then runs the chain rule in reverse by hand: for
  ``y = x / (sum_d x + eps)``, ``dx = (dy - sum_d(dy * y)) / (sum_d x + eps)``; softmax
  ``da = p * (dp - sum(dp * p))``; sigmoid ``da = dy * s * (1 - s)``. ~120 small launches.
- "tilelang" (``_bwd_tl``, ``hc_split_sinkhorn_bwd_kernel``): the same maths per token in one kernel,
  keeping only the denominators and rebuilding each step's input as ``y * den`` during the reverse sweep.
Both are plain tensor maths / kernels with no autograd inside, so they work under ``torch.autograd`` and
``torch.func.grad``/``vjp`` alike.
"""
import functools
import os

import torch
import tilelang.language as T

from ._common import compile_kernel

F32 = "float32"


@functools.lru_cache(maxsize=None)
def hc_split_sinkhorn_kernel(hc: int, iters: int, eps: float, threads: int = 128, div: str = "ieee"):
    """mixes [N, (2+hc)*hc] fp32, scale [3], base [(2+hc)*hc] -> pre [N, hc], post [N, hc], comb [N, hc*hc].

    ``div`` (softmax and Sinkhorn normalisations): "ieee" hc IEEE divisions per sum (as the reference);
    "rcp" one IEEE reciprocal per sum + hc multiplies (fewer instructions, same dependent chain);
    "approx" one MUFU reciprocal (~1 ulp) + multiplies (shortest chain). The last two round differently
    by ~1 ulp a step; Sinkhorn's normalisations are self-correcting so this stays ~1e-7 absolute
    (DESIGN asks fp32 within 1e-5 on the GPU; the CPU path stays bit-exact with the reference).
    ``threads``: tokens per CTA (one thread each)."""
    assert div in ("ieee", "rcp", "approx"), div

    def _inv(x):
        return T.ieee_frcp(x) if div == "rcp" else T.fast_rcp(x)
    N = T.dynamic("N")
    W = (2 + hc) * hc
    HH = hc * hc
    C0 = 2 * hc

    @T.macro
    def _row_norm(c, acc):
        for i in T.unroll(hc):
            acc[0] = c[i * hc]
            for j in T.unroll(1, hc):
                acc[0] = acc[0] + c[i * hc + j]
            if div != "ieee":
                acc[0] = _inv(acc[0] + T.float32(eps))
                for j in T.unroll(hc):
                    c[i * hc + j] = c[i * hc + j] * acc[0]
            else:
                for j in T.unroll(hc):
                    c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0] + T.float32(eps))

    @T.macro
    def _col_norm(c, acc):
        for j in T.unroll(hc):
            acc[0] = c[j]
            for i in T.unroll(1, hc):
                acc[0] = acc[0] + c[i * hc + j]
            if div != "ieee":
                acc[0] = _inv(acc[0] + T.float32(eps))
                for i in T.unroll(hc):
                    c[i * hc + j] = c[i * hc + j] * acc[0]
            else:
                for i in T.unroll(hc):
                    c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0] + T.float32(eps))

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
                    if div != "ieee":
                        acc[0] = _inv(acc[0])
                        for j in T.unroll(hc):
                            c[i * hc + j] = c[i * hc + j] * acc[0] + T.float32(eps)
                    else:
                        for j in T.unroll(hc):
                            c[i * hc + j] = T.ieee_fdiv(c[i * hc + j], acc[0]) + T.float32(eps)
                # column normalisation, then (iters - 1) x (row, column)
                _col_norm(c, acc)
                for _ in T.serial(iters - 1):
                    _row_norm(c, acc)
                    _col_norm(c, acc)
                for k in T.unroll(HH):
                    Comb[n, k] = c[k]

    return compile_kernel(hc_split_sinkhorn, out_idx=[3, 4, 5])


@functools.lru_cache(maxsize=None)
def hc_split_sinkhorn_bwd_kernel(hc: int, iters: int, eps: float, threads: int = 128, div: str = "rcp"):
    """Backward, one thread per token: mixes [N, W], scale [3], base [W], g_pre [N, hc], g_post [N, hc],
    g_comb [N, hc*hc] -> d mixes [N, W] and per-CTA partial sums [ceil(N / threads), W + 3] of
    (d base [W], d scale [3]) (W = (2+hc)*hc; the caller sums the partials over CTAs).

    Recomputes the forward in registers keeping only the 2*iters*hc denominators ``den = sum + eps``
    (local memory, 640 B/thread at hc 4 / 20 iterations), then sweeps the normalisations in reverse:
    for ``y = x / den`` (den broadcast along the summed dim), ``dx = (dy - sum_d(dy * y)) / den`` and
    ``x = y * den`` rebuilds the step's input from its output (no stored matrices; rounding drift
    ~1e-6 relative after 40 steps, checked on CPU against float64 autograd). Softmax
    ``da = p * (dp - sum_j dp * p)`` with p recomputed; sigmoid ``da = g * s * (1 - s)`` (x2 for post).
    Divisions by den are one reciprocal + multiplies (gradients need ~1e-4 relative, not bits):
    ``div`` "rcp" IEEE reciprocal, "approx" the MUFU one (~1 ulp, shorter dependent chain).

    d scale / d base are token reductions: each CTA reduces its ``threads`` tokens through shared memory
    in a fixed order and writes one partial row; the caller adds the ceil(N / threads) rows (one small
    torch sum). Chosen over fp32 atomics for determinism (the same gradients on every run) and because
    27 addresses hit by 4096 atomics each would serialise in L2 anyway."""
    N = T.dynamic("N")
    NB = T.dynamic("NB")
    W = (2 + hc) * hc
    HH = hc * hc
    C0 = 2 * hc
    R = W + 3
    S = 2 * iters - 1                        # normalisation steps: column, then (row, column) x (iters-1)
    assert R <= threads and div in ("rcp", "approx"), (R, threads, div)

    def _inv(x):
        return T.ieee_frcp(x) if div == "rcp" else T.fast_rcp(x)

    @T.prim_func
    def hc_split_sinkhorn_bwd(
        Mx: T.Tensor([N, W], F32),
        Sc: T.Tensor([3], F32),
        Bs: T.Tensor([W], F32),
        Gp: T.Tensor([N, hc], F32),
        Gq: T.Tensor([N, hc], F32),
        Gc: T.Tensor([N, HH], F32),
        Dm: T.Tensor([N, W], F32),
        Part: T.Tensor([NB, R], F32),
    ):
        with T.Kernel(T.ceildiv(N, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            m = T.alloc_local([W], F32)
            p = T.alloc_local([HH], F32)          # softmax output (no eps)
            c = T.alloc_local([HH], F32)          # y of the current step (forward, then rebuilt in reverse)
            g = T.alloc_local([HH], F32)          # gradient w.r.t. c
            den = T.alloc_local([S * hc], F32)    # sum + eps of every step
            red = T.alloc_local([R], F32)         # this token's d base (W) and d scale (3)
            acc = T.alloc_local([1], F32)
            r = T.alloc_local([1], F32)
            sh = T.alloc_shared([threads, R], F32)
            n = bx * threads + tx
            for k in T.unroll(R):
                red[k] = T.float32(0.0)
            if n < N:
                for k in T.unroll(W):
                    m[k] = Mx[n, k]
                # sigmoid parts: d a = g * s * (1 - s); post = 2 * sigmoid
                for k in T.unroll(hc):
                    acc[0] = T.ieee_fdiv(T.float32(1.0), T.float32(1.0) + T.exp(-(m[k] * Sc[0] + Bs[k])))
                    red[k] = Gp[n, k] * acc[0] * (T.float32(1.0) - acc[0])
                    acc[0] = T.ieee_fdiv(T.float32(1.0), T.float32(1.0) + T.exp(-(m[hc + k] * Sc[1] + Bs[hc + k])))
                    red[hc + k] = T.float32(2.0) * Gq[n, k] * acc[0] * (T.float32(1.0) - acc[0])
                # forward recompute: softmax, then the normalisations keeping den
                for k in T.unroll(HH):
                    p[k] = m[C0 + k] * Sc[2] + Bs[C0 + k]
                for i in T.unroll(hc):
                    acc[0] = p[i * hc]
                    for j in T.unroll(1, hc):
                        acc[0] = T.max(acc[0], p[i * hc + j])
                    for j in T.unroll(hc):
                        p[i * hc + j] = T.exp(p[i * hc + j] - acc[0])
                    acc[0] = p[i * hc]
                    for j in T.unroll(1, hc):
                        acc[0] = acc[0] + p[i * hc + j]
                    acc[0] = _inv(acc[0])
                    for j in T.unroll(hc):
                        p[i * hc + j] = p[i * hc + j] * acc[0]
                        c[i * hc + j] = p[i * hc + j] + T.float32(eps)
                for st in T.serial(S):
                    if st % 2 == 0:                  # column step (sum over rows i)
                        for j in T.unroll(hc):
                            acc[0] = c[j]
                            for i in T.unroll(1, hc):
                                acc[0] = acc[0] + c[i * hc + j]
                            den[st * hc + j] = acc[0] + T.float32(eps)
                            r[0] = _inv(acc[0] + T.float32(eps))
                            for i in T.unroll(hc):
                                c[i * hc + j] = c[i * hc + j] * r[0]
                    else:                            # row step (sum over columns j)
                        for i in T.unroll(hc):
                            acc[0] = c[i * hc]
                            for j in T.unroll(1, hc):
                                acc[0] = acc[0] + c[i * hc + j]
                            den[st * hc + i] = acc[0] + T.float32(eps)
                            r[0] = _inv(acc[0] + T.float32(eps))
                            for j in T.unroll(hc):
                                c[i * hc + j] = c[i * hc + j] * r[0]
                # reverse sweep
                for k in T.unroll(HH):
                    g[k] = Gc[n, k]
                for rs in T.serial(S):
                    if (S - 1 - rs) % 2 == 0:        # column step
                        for j in T.unroll(hc):
                            acc[0] = g[j] * c[j]
                            for i in T.unroll(1, hc):
                                acc[0] = acc[0] + g[i * hc + j] * c[i * hc + j]
                            r[0] = den[(S - 1 - rs) * hc + j]
                            for i in T.unroll(hc):
                                c[i * hc + j] = c[i * hc + j] * r[0]
                            r[0] = _inv(r[0])
                            for i in T.unroll(hc):
                                g[i * hc + j] = (g[i * hc + j] - acc[0]) * r[0]
                    else:                            # row step
                        for i in T.unroll(hc):
                            acc[0] = g[i * hc] * c[i * hc]
                            for j in T.unroll(1, hc):
                                acc[0] = acc[0] + g[i * hc + j] * c[i * hc + j]
                            r[0] = den[(S - 1 - rs) * hc + i]
                            for j in T.unroll(hc):
                                c[i * hc + j] = c[i * hc + j] * r[0]
                            r[0] = _inv(r[0])
                            for j in T.unroll(hc):
                                g[i * hc + j] = (g[i * hc + j] - acc[0]) * r[0]
                # softmax: d a = p * (g - sum_j g * p)
                for i in T.unroll(hc):
                    acc[0] = g[i * hc] * p[i * hc]
                    for j in T.unroll(1, hc):
                        acc[0] = acc[0] + g[i * hc + j] * p[i * hc + j]
                    for j in T.unroll(hc):
                        red[C0 + i * hc + j] = p[i * hc + j] * (g[i * hc + j] - acc[0])
                # d mixes = d a * scale; d scale = sum d a * mixes per segment
                for k in T.unroll(hc):
                    Dm[n, k] = red[k] * Sc[0]
                    Dm[n, hc + k] = red[hc + k] * Sc[1]
                    red[W] = red[W] + red[k] * m[k]
                    red[W + 1] = red[W + 1] + red[hc + k] * m[hc + k]
                for k in T.unroll(HH):
                    Dm[n, C0 + k] = red[C0 + k] * Sc[2]
                    red[W + 2] = red[W + 2] + red[C0 + k] * m[C0 + k]
            # per-CTA partials: fixed-order sums over the CTA's tokens (deterministic)
            for k in T.unroll(R):
                sh[tx, k] = red[k]
            if tx < R:
                acc[0] = T.float32(0.0)
                for t in T.serial(threads):
                    acc[0] = acc[0] + sh[t, tx]
                Part[bx, tx] = acc[0]

    return compile_kernel(hc_split_sinkhorn_bwd)


# Forward/backward configuration (tokens per CTA, how x / (sum + eps) divides); the bench sweeps them.
# Run 9 (BENCHMARKS.md), [4096] tokens, CUDA-graph times: forward 23 us with IEEE divisions at any CTA size,
# 11 us with an IEEE reciprocal + multiply, 4 us with MUFU rcp.approx at 32 tokens/CTA; backward 28 us (rcp) /
# 15 us (approx). The approximate reciprocal is ~1 ulp; the alternating normalisations do not accumulate it
# (max abs error vs the reference 3.6e-7, tests bound 1e-5), so the fastest is the default.
FWD_THREADS = 32
FWD_DIV = "approx"
BWD_THREADS = 128
BWD_DIV = "approx"


def _fwd(mixes, hc_scale, hc_base, hc, iters, eps):
    lead = mixes.shape[:-1]
    m = mixes.float().reshape(-1, mixes.shape[-1]).contiguous()
    if m.shape[0] == 0:
        z = m.new_zeros(*lead, hc)
        return z, z.clone(), m.new_zeros(*lead, hc, hc)
    k = hc_split_sinkhorn_kernel(int(hc), int(iters), float(eps), FWD_THREADS, FWD_DIV)
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


def _bwd_tl(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, hc, iters, eps, threads=None, div=None):
    """Same contract as ``_bwd``, by ``hc_split_sinkhorn_bwd_kernel`` (+ one torch sum of its per-CTA
    partials). Goes through ``_HcBwdKernel`` so that under ``torch.func.grad`` the kernel sees plain
    tensors (functorch unwraps the inputs of an autograd.Function's forward, not of its backward)."""
    return _HcBwdKernel.apply(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, hc, iters, eps,
                              threads or BWD_THREADS, div or BWD_DIV)


def _bwd_tl_run(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, hc, iters, eps, threads=128, div="rcp"):
    W = mixes.shape[-1]
    m = mixes.float().reshape(-1, W).contiguous()
    N = m.shape[0]
    if N == 0:
        return torch.zeros_like(mixes), torch.zeros_like(hc_scale), torch.zeros_like(hc_base)
    nb = (N + threads - 1) // threads
    dm = torch.empty_like(m)
    part = m.new_empty(nb, W + 3)
    k = hc_split_sinkhorn_bwd_kernel(int(hc), int(iters), float(eps), int(threads), div)
    k(m, hc_scale.float().contiguous(), hc_base.float().contiguous(),
      g_pre.float().reshape(N, hc).contiguous(), g_post.float().reshape(N, hc).contiguous(),
      g_comb.float().reshape(N, hc * hc).contiguous(), dm, part)
    red = part.sum(0)
    return (dm.reshape(mixes.shape).to(mixes.dtype), red[W:].to(hc_scale.dtype), red[:W].to(hc_base.dtype))


class _HcBwdKernel(torch.autograd.Function):
    """The backward kernel as a function of its own (first-order gradients only)."""

    @staticmethod
    def forward(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, hc, iters, eps, threads, div):
        return _bwd_tl_run(mixes, hc_scale, hc_base, g_pre, g_post, g_comb, hc, iters, eps, threads, div)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("hc_split_sinkhorn bwd='tilelang' is first-order only; use bwd='torch' "
                                  "for double backward")


# Backward used when ``hc_split_sinkhorn(bwd=None)``: "torch" (recompute in torch, ``_bwd``) or
# "tilelang" (``hc_split_sinkhorn_bwd_kernel``: 0.02 ms at [4096] tokens against 2.5 ms for the torch
# recompute, gradients within 5e-7 of float64 autograd in run 9).
BWD_DEFAULT = os.environ.get("DSV41_HC_BWD", "tilelang")
_BWD = {"torch": _bwd, "tilelang": _bwd_tl}


class _HcSplitSinkhorn(torch.autograd.Function):
    """TileLang forward; backward by ``_BWD[bwd]`` (setup_context form, for torch.func transforms)."""

    @staticmethod
    def forward(mixes, hc_scale, hc_base, hc, iters, eps, bwd):
        return _fwd(mixes, hc_scale, hc_base, hc, iters, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        mixes, hc_scale, hc_base, hc, iters, eps, bwd = inputs
        ctx.save_for_backward(mixes, hc_scale, hc_base)
        ctx.cfg = (hc, iters, eps)
        ctx.bwd = bwd

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        mixes, hc_scale, hc_base = ctx.saved_tensors
        dm, dsc, dbs = _BWD[ctx.bwd](mixes, hc_scale, hc_base, g_pre, g_post, g_comb, *ctx.cfg)
        return dm, dsc, dbs, None, None, None, None


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6, bwd: str | None = None):
    """Same contract as ``reference.hc_split_sinkhorn``: (pre [.., hc], post [.., hc], comb [.., hc, hc]) fp32.

    ``bwd``: "torch" (recompute in torch) or "tilelang" (backward kernel); None -> ``BWD_DEFAULT``."""
    from .. import reference
    bwd = BWD_DEFAULT if bwd is None else bwd
    if bwd not in _BWD:
        raise ValueError(f"hc_split_sinkhorn: bwd must be one of {list(_BWD)}, got {bwd!r}")
    reference.check_hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult)
    if sinkhorn_iters < 1:
        return reference.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)
    return _HcSplitSinkhorn.apply(mixes, hc_scale, hc_base, int(hc_mult), int(sinkhorn_iters), float(eps), bwd)
