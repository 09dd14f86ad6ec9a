"""Lightning indexer scores (SPEC §5) in TileLang for Hopper: fused scoring + visibility mask, and backward.

Scoring, ``I[b, t, j] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, j])`` over the visible range
``lo[b, t] <= j < hi[b, t]`` (and the candidate mask of level 2), -inf elsewhere. Grid (query blocks
of BQ, entry chunks C, batch): the BQ*Hi (query, head) rows are the GEMM's M (BQ=4, Hi=32 -> 128), an
entry block of BN rows its N, Di its K. C = 1 when the query blocks fill the GPU (release prefill:
1024 CTAs); few queries on long rows (64 x 16K, 16 x 64K entries) split the row into chunks so that
about 2 waves of CTAs run (run 9: with C = 1 those rows ran 4-16 CTAs, 5-20 TFLOP/s). Inside a CTA
the entry blocks that meet its queries' ranges run a T.Pipelined loop (TileLang makes it a TMA
producer warp group + mbarriers, so the next K block loads during this block's GEMM and head sum);
blocks wholly outside every range (causal prefill: about half) only store -inf. Per block, as the
reference rounds: each dot product (fp32 accumulate) -> bf16, ReLU, times w -> bf16, then the sum
over the Hi heads in fp32 (through shared memory, heads in order; variant hsum="gemm": a 0/1 selector
GEMM) -> bf16. The fp32 sum order is the only difference from torch (<= 1 bf16 ulp on a few outputs);
chunks and stages do not change it.

Top-k and the level-1 candidate blocks: ``index_topk_tl.py``.

Backward of the scores (``dq, dk, dw``): two kernels that recompute q.k per block (no [s, Hi, n]
tensor): dq and dw per query block in registers (pipelined K loads; on few-query long rows split over
entry chunks like the scoring, partial dq / dw added with fp32 atomics), dk per entry block with the
query blocks split over P CTAs and fp32 atomics (``BWD_KERNEL = False`` uses autograd of the torch
reference instead).
"""

import functools

import torch
import tilelang.language as T

from ._common import compile_kernel, sm_count, plain as _plain

BF16, F32, I32 = "bfloat16", "float32", "int32"


def _query_block(H: int, BQ: int):
    """The loads the scoring and dq/dw kernels share, as a macro: the BQ queries' Q rows (BQ*H GEMM rows),
    their head weights (fp32) and their visible entry ranges [lo, hi). (The union of the ranges is then
    computed in each kernel: TileLang macros cannot assign the kernels' scalar variables.)"""
    M = BQ * H

    @T.macro
    def load(Q, W, Lo, Hi, q_s, w_f, lo_s, hi_s, bi, q0):
        for m, d in T.Parallel(M, Q.shape[-1]):
            q_s[m, d] = Q[bi, q0 + m // H, m % H, d]
        for m in T.Parallel(M):
            w_f[m] = T.Cast(F32, W[bi, q0 + m // H, m % H])
        for t in T.Parallel(BQ):
            lo_s[t] = Lo[bi, q0 + t]
            hi_s[t] = Hi[bi, q0 + t]

    return load


# ----------------------------------------------------------------------------- scoring
@functools.lru_cache(maxsize=None)
def score_kernel(H: int, D: int, BQ: int = 4, BN: int = 128, has_cand: bool = False, threads: int = 256,
                 stages: int = 2, hsum: str = "smem"):
    """O = score(Q [B, S, H, D], K [B, N, D], W [B, S, H], Lo [B, S], Hi [B, S][, Cand [B, S, N] int8],
    Chunk [C]).

    Grid (S/BQ, C, B): CTA (qb, c) owns the entry blocks [c*per, (c+1)*per), per = ceil(ceil(N/BN)/C)
    (only Chunk's length C is read: the launcher picks C so that few-query, long rows still fill the
    GPU; C = 1 is one CTA per query block over the whole row). Inside, the blocks that intersect the
    union of the BQ queries' ranges run a T.Pipelined loop (``stages`` K buffers, cp.async, so the
    next block's K load overlaps this block's GEMM and head sum); the others only store -inf. S a
    multiple of BQ (the launcher pads queries); N any (tails guarded). Per-output rounding is the
    same whatever C and stages are: the chunks split entries, never the head sum.

    ``hsum``: how the Hi per-head terms r = bf16(ReLU(bf16(q.k)) * w) of a query are summed. "smem":
    r in fp32 shared memory, each (query, entry) output adds its Hi terms in order (Hi shared loads
    per output). "gemm": r stored as bf16 (exact: r IS a bf16 value) and the sums taken by a second
    tensor-core GEMM, Sel [64, BQ*Hi] (0/1, row t selects query t's heads) x r [BQ*Hi, BN] with fp32
    accumulation; only the order / rounding of the fp32 partial sums differs (far below a bf16 ulp)."""
    B, S, N, C = T.dynamic("B"), T.dynamic("S"), T.dynamic("N"), T.dynamic("C")
    M = BQ * H
    load_queries = _query_block(H, BQ)

    @T.macro
    def body(Q, K, W, Lo, Hi, Cand, O):
        with T.Kernel(S // BQ, C, B, threads=threads) as (qb, c, bi):
            q_s = T.alloc_shared([M, D], BF16)
            k_s = T.alloc_shared([BN, D], BF16)
            if hsum == "gemm":
                r_s = T.alloc_shared([M, BN], BF16)
                sel_s = T.alloc_shared([64, M], BF16)
                s_acc = T.alloc_fragment([64, BN], F32)
            else:
                r_s = T.alloc_shared([M, BN], F32)
            w_f = T.alloc_fragment([M], F32)
            acc = T.alloc_fragment([M, BN], F32)
            lo_s = T.alloc_shared([BQ], I32)
            hi_s = T.alloc_shared([BQ], I32)
            jlo = T.alloc_var(I32)
            jhi = T.alloc_var(I32)
            v_lo = T.alloc_var(I32)
            v_hi = T.alloc_var(I32)

            nblk = T.ceildiv(N, BN)
            per = T.ceildiv(nblk, C)
            b_lo = c * per
            b_hi = T.min(b_lo + per, nblk)
            q0 = qb * BQ
            load_queries(Q, W, Lo, Hi, q_s, w_f, lo_s, hi_s, bi, q0)
            if hsum == "gemm":
                for r, m in T.Parallel(64, M):
                    sel_s[r, m] = T.if_then_else(m // H == r, T.Cast(BF16, 1.0), T.Cast(BF16, 0.0))
            jlo = N
            jhi = 0
            for t in T.serial(BQ):
                if lo_s[t] < hi_s[t]:
                    jlo = T.min(jlo, lo_s[t])
                    jhi = T.max(jhi, hi_s[t])
            # entry blocks of this chunk that intersect [jlo, jhi): [v_lo, v_hi) (empty when jhi <= jlo)
            v_lo = T.max(b_lo, jlo // BN)
            v_hi = T.min(b_hi, T.ceildiv(jhi, BN))
            v_hi = T.max(v_hi, v_lo)

            for i in T.Pipelined(v_hi - v_lo, num_stages=stages):
                j0 = (v_lo + i) * BN
                T.copy(K[bi, j0:j0 + BN, :], k_s)
                T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if hsum == "gemm":
                    for m, j in T.Parallel(M, BN):
                        r_s[m, j] = T.Cast(BF16, T.max(T.Cast(F32, T.Cast(BF16, acc[m, j])), 0.0) * w_f[m])
                    T.gemm(sel_s, r_s, s_acc, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for t, j in T.Parallel(64, BN):
                        if t < BQ and j0 + j < N:
                            vis_g = (j0 + j >= lo_s[t % BQ]) and (j0 + j < hi_s[t % BQ])
                            if has_cand:
                                vis_g = vis_g and (Cand[bi, q0 + t % BQ, j0 + j] != 0)
                            O[bi, q0 + t % BQ, j0 + j] = T.if_then_else(vis_g, T.Cast(BF16, s_acc[t, j]), -T.infinity(BF16))
                else:
                    for m, j in T.Parallel(M, BN):
                        r_s[m, j] = T.Cast(F32, T.Cast(BF16, T.max(T.Cast(F32, T.Cast(BF16, acc[m, j])), 0.0) * w_f[m]))
                    for t, j in T.Parallel(BQ, BN):
                        if j0 + j < N:
                            acc_t = T.alloc_var(F32)
                            acc_t = 0.0
                            for h in T.serial(H):
                                acc_t += r_s[t * H + h, j]
                            vis = (j0 + j >= lo_s[t]) and (j0 + j < hi_s[t])
                            if has_cand:
                                vis = vis and (Cand[bi, q0 + t, j0 + j] != 0)
                            O[bi, q0 + t, j0 + j] = T.if_then_else(vis, T.Cast(BF16, acc_t), -T.infinity(BF16))
            for e in T.serial(per):
                nb = b_lo + e
                if nb < b_hi and (nb < v_lo or nb >= v_hi):
                    for t, j in T.Parallel(BQ, BN):
                        if nb * BN + j < N:
                            O[bi, q0 + t, nb * BN + j] = -T.infinity(BF16)

    if has_cand:
        @T.prim_func
        def index_score_cand(
            Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
            Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32), Cand: T.Tensor([B, S, N], "int8"),
            Chunk: T.Tensor([C], I32), O: T.Tensor([B, S, N], BF16),
        ):
            body(Q, K, W, Lo, Hi, Cand, O)
        return compile_kernel(index_score_cand, out_idx=[7])

    @T.prim_func
    def index_score(
        Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
        Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32), Chunk: T.Tensor([C], I32),
        O: T.Tensor([B, S, N], BF16),
    ):
        body(Q, K, W, Lo, Hi, None, O)
    return compile_kernel(index_score, out_idx=[6])


# ----------------------------------------------------------------------------- backward of the scores
# dS[t, h, j] = bf16(dI[t, j] * w[t, h]) * (q.k > 0) (as the reference's autograd rounds it), with dI
# zeroed outside the visible range / candidates; dq = dS k, dk = dS^T q, dw[t, h] = sum_j dI ReLU(q.k).
# q.k is recomputed per block (no [s, Hi, n] tensor). Two kernels: one over query blocks (dq, dw, in
# registers), one over entry blocks (dk in registers, query blocks split over P CTAs + fp32 atomics).
@functools.lru_cache(maxsize=None)
def bwd_q_kernel(H: int, D: int, BQ: int = 4, BN: int = 64, has_cand: bool = False, threads: int = 256,
                 split: bool = False, stages: int = 0):
    """dQ [B, S, H, D], dW [B, S, H] fp32 = bwd_q(Q, K, W, Lo, Hi[, Cand], dI, Chunk [C]); S a multiple of BQ.

    Grid (S/BQ, C, B): CTA (qb, c) takes the entry blocks [c*per, (c+1)*per) (as the scoring kernel)
    that intersect its queries' ranges, in a T.Pipelined loop of ``stages`` buffers. ``split=False``:
    C must be 1, dQ is bf16 and both outputs are written (fp32 sum over the row in block order, as
    before). ``split=True`` (few queries, long rows): dQ and dW are fp32 buffers zeroed by the caller
    and each chunk's partial sums are added with fp32 atomics (the caller rounds dQ to bf16); the
    order of the fp32 sum over chunks is then arbitrary (fp32 rounding only, far below bf16)."""
    B, S, N, C = T.dynamic("B"), T.dynamic("S"), T.dynamic("N"), T.dynamic("C")
    M = BQ * H
    load_queries = _query_block(H, BQ)

    @T.macro
    def body(Q, K, W, Lo, Hi, Cand, dI, dQ, dW):
        with T.Kernel(S // BQ, C, B, threads=threads) as (qb, c, bi):
            q_s = T.alloc_shared([M, D], BF16)
            k_s = T.alloc_shared([BN, D], BF16)
            ds_s = T.alloc_shared([M, BN], BF16)
            g_s = T.alloc_shared([BQ, BN], F32)
            w_f = T.alloc_fragment([M], F32)
            acc = T.alloc_fragment([M, BN], F32)
            dwb = T.alloc_fragment([M, BN], F32)
            dw_blk = T.alloc_fragment([M], F32)
            dw_f = T.alloc_fragment([M], F32)
            dq = T.alloc_fragment([M, D], F32)
            lo_s = T.alloc_shared([BQ], I32)
            hi_s = T.alloc_shared([BQ], I32)
            jlo = T.alloc_var(I32)
            jhi = T.alloc_var(I32)
            v_lo = T.alloc_var(I32)
            v_hi = T.alloc_var(I32)

            nblk = T.ceildiv(N, BN)
            per = T.ceildiv(nblk, C)
            b_lo = c * per
            b_hi = T.min(b_lo + per, nblk)
            q0 = qb * BQ
            load_queries(Q, W, Lo, Hi, q_s, w_f, lo_s, hi_s, bi, q0)
            T.clear(dq)
            T.clear(dw_f)
            jlo = N
            jhi = 0
            for t in T.serial(BQ):
                if lo_s[t] < hi_s[t]:
                    jlo = T.min(jlo, lo_s[t])
                    jhi = T.max(jhi, hi_s[t])
            v_lo = T.max(b_lo, jlo // BN)
            v_hi = T.min(b_hi, T.ceildiv(jhi, BN))
            v_hi = T.max(v_hi, v_lo)
            for i in T.Pipelined(v_hi - v_lo, num_stages=stages):
                j0 = (v_lo + i) * BN
                T.copy(K[bi, j0:j0 + BN, :], k_s)
                for t, j in T.Parallel(BQ, BN):
                    vis = (j0 + j >= lo_s[t]) and (j0 + j < hi_s[t]) and (j0 + j < N)
                    if has_cand:
                        vis = vis and (Cand[bi, q0 + t, T.min(j0 + j, N - 1)] != 0)
                    g_s[t, j] = T.if_then_else(vis, T.Cast(F32, dI[bi, q0 + t, T.min(j0 + j, N - 1)]), 0.0)
                T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for m, j in T.Parallel(M, BN):
                    dwb[m, j] = g_s[m // H, j] * T.max(T.Cast(F32, T.Cast(BF16, acc[m, j])), 0.0)
                    ds_s[m, j] = T.if_then_else(T.Cast(F32, T.Cast(BF16, acc[m, j])) > 0,
                                                T.Cast(BF16, g_s[m // H, j] * w_f[m]), T.Cast(BF16, 0))
                T.reduce_sum(dwb, dw_blk, dim=1)
                for m in T.Parallel(M):
                    dw_f[m] += dw_blk[m]
                T.gemm(ds_s, k_s, dq, policy=T.GemmWarpPolicy.FullRow)
            if split:
                if v_hi > v_lo:
                    for m, d in T.Parallel(M, D):
                        T.atomic_add(dQ[bi, q0 + m // H, m % H, d], dq[m, d])
                    for m in T.Parallel(M):
                        T.atomic_add(dW[bi, q0 + m // H, m % H], dw_f[m])
            else:
                for m, d in T.Parallel(M, D):
                    dQ[bi, q0 + m // H, m % H, d] = T.Cast(BF16, dq[m, d])
                for m in T.Parallel(M):
                    dW[bi, q0 + m // H, m % H] = dw_f[m]

    QT = F32 if split else BF16
    if has_cand:
        @T.prim_func
        def index_score_bwd_q_cand(
            Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
            Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32), Cand: T.Tensor([B, S, N], "int8"),
            dI: T.Tensor([B, S, N], BF16), Chunk: T.Tensor([C], I32),
            dQ: T.Tensor([B, S, H, D], QT), dW: T.Tensor([B, S, H], F32),
        ):
            body(Q, K, W, Lo, Hi, Cand, dI, dQ, dW)
        return compile_kernel(index_score_bwd_q_cand, out_idx=None if split else [8, 9])

    @T.prim_func
    def index_score_bwd_q(
        Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
        Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32),
        dI: T.Tensor([B, S, N], BF16), Chunk: T.Tensor([C], I32),
        dQ: T.Tensor([B, S, H, D], QT), dW: T.Tensor([B, S, H], F32),
    ):
        body(Q, K, W, Lo, Hi, None, dI, dQ, dW)
    return compile_kernel(index_score_bwd_q, out_idx=None if split else [7, 8])


@functools.lru_cache(maxsize=None)
def bwd_k_kernel(H: int, D: int, BQ: int = 4, BN: int = 64, has_cand: bool = False, threads: int = 256):
    """dK [B, N, D] fp32 += bwd_k(Q, K, W, Lo, Hi[, Cand], dI, Split [P]); grid (N/BN, P, B): CTA (nb, p)
    takes query blocks p, p + P, ... and adds its partial dk with fp32 atomics (dK zeroed by the caller)."""
    B, S, N, P = T.dynamic("B"), T.dynamic("S"), T.dynamic("N"), T.dynamic("P")
    M = BQ * H

    @T.macro
    def body(Q, K, W, Lo, Hi, Cand, dI, Split, dK):
        with T.Kernel(T.ceildiv(N, BN), P, B, threads=threads) as (nb, p, bi):
            q_s = T.alloc_shared([M, D], BF16)
            k_s = T.alloc_shared([BN, D], BF16)
            ds_s = T.alloc_shared([BN, M], BF16)
            g_s = T.alloc_shared([BQ, BN], F32)
            w_s = T.alloc_shared([M], F32)
            acc = T.alloc_fragment([BN, M], F32)
            dk = T.alloc_fragment([BN, D], F32)
            lo_s = T.alloc_shared([BQ], I32)
            hi_s = T.alloc_shared([BQ], I32)
            hit = T.alloc_var(I32)

            j0 = nb * BN
            for j, d in T.Parallel(BN, D):
                k_s[j, d] = T.if_then_else(j0 + j < N, K[bi, j0 + j, d], T.Cast(BF16, 0))
            T.clear(dk)
            for i in T.serial(T.ceildiv(S // BQ, P)):
                qb = p + i * P
                if qb < S // BQ:
                    q0 = qb * BQ
                    for t in T.Parallel(BQ):
                        lo_s[t] = Lo[bi, q0 + t]
                        hi_s[t] = Hi[bi, q0 + t]
                    hit = 0
                    for t in T.serial(BQ):
                        if lo_s[t] < hi_s[t] and lo_s[t] < j0 + BN and hi_s[t] > j0:
                            hit = 1
                    if hit == 1:
                        for m, d in T.Parallel(M, D):
                            q_s[m, d] = Q[bi, q0 + m // H, m % H, d]
                        for m in T.Parallel(M):
                            w_s[m] = T.Cast(F32, W[bi, q0 + m // H, m % H])
                        for t, j in T.Parallel(BQ, BN):
                            vis = (j0 + j >= lo_s[t]) and (j0 + j < hi_s[t]) and (j0 + j < N)
                            if has_cand:
                                vis = vis and (Cand[bi, q0 + t, T.min(j0 + j, N - 1)] != 0)
                            g_s[t, j] = T.if_then_else(vis, T.Cast(F32, dI[bi, q0 + t, T.min(j0 + j, N - 1)]), 0.0)
                        T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        for j, m in T.Parallel(BN, M):
                            ds_s[j, m] = T.if_then_else(T.Cast(F32, T.Cast(BF16, acc[j, m])) > 0,
                                                        T.Cast(BF16, g_s[m // H, j] * w_s[m]), T.Cast(BF16, 0))
                        T.gemm(ds_s, q_s, dk, policy=T.GemmWarpPolicy.FullRow)
            for j, d in T.Parallel(BN, D):
                if j0 + j < N:
                    T.atomic_add(dK[bi, j0 + j, d], dk[j, d])

    if has_cand:
        @T.prim_func
        def index_score_bwd_k_cand(
            Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
            Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32), Cand: T.Tensor([B, S, N], "int8"),
            dI: T.Tensor([B, S, N], BF16), Split: T.Tensor([P], I32), dK: T.Tensor([B, N, D], F32),
        ):
            body(Q, K, W, Lo, Hi, Cand, dI, Split, dK)
        return compile_kernel(index_score_bwd_k_cand)

    @T.prim_func
    def index_score_bwd_k(
        Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
        Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32),
        dI: T.Tensor([B, S, N], BF16), Split: T.Tensor([P], I32), dK: T.Tensor([B, N, D], F32),
    ):
        body(Q, K, W, Lo, Hi, None, dI, Split, dK)
    return compile_kernel(index_score_bwd_k)


# ----------------------------------------------------------------------------- launch helpers
# Run 10 (H200): stages=0 (synchronous K loads) 0.137 ms at the release shape vs 0.275 with the 2-stage TMA
# pipeline (the producer warpgroup costs a CTA per SM), and equal on long rows (0.063-0.066 ms); hsum="gemm"
# slower (0.317). Run 11 (stages 0): two waves of entry chunks beat one on long rows (64 x 16K: 0.064 vs
# 0.084 ms; 16 x 64K: 0.066 vs 0.090).
SCORE_CFG = dict(BQ=4, BN=128, threads=256, stages=0, hsum="smem")
WAVES = 2               # entry chunks aim at WAVES * SMs CTAs when the query blocks alone do not fill the GPU


def _chunks(qblocks: int, nblk: int, sms: int, chunks=None) -> int:
    """Entry chunks C for a grid of ``qblocks`` query blocks (x batch) over ``nblk`` entry blocks: 1 when
    the query blocks already fill the SMs (release prefill: 1024 CTAs, today's behaviour), else enough
    chunks for about WAVES * sms CTAs. Rounded so every chunk has blocks (C = ceil(nblk / per))."""
    if chunks is None:
        chunks = 1 if qblocks >= sms else -(-WAVES * sms // max(1, qblocks))
    c = max(1, min(int(chunks), nblk))
    per = -(-nblk // c)
    return -(-nblk // per)


@functools.lru_cache(maxsize=None)
def _chunk_arg(c: int, device) -> torch.Tensor:
    """The kernels read only the length of this tensor (the dynamic grid size C)."""
    return torch.empty(c, dtype=torch.int32, device=device)


def _score_fwd(q, k, w, lo, hi, cand=None, cfg=None):
    """Launch the scoring kernel: pads the queries to a multiple of BQ (padded rows see nothing).
    cfg: the kernel's BQ, BN, threads, stages, and ``chunks`` (entry chunks; default by _chunks)."""
    cfg = dict(SCORE_CFG, **(cfg or {}))
    chunks = cfg.pop("chunks", None)
    b, s, H, D = q.shape
    n = k.shape[1]
    BQ = cfg["BQ"]
    sp = -(-s // BQ) * BQ
    lo, hi = lo.to(torch.int32), hi.to(torch.int32)
    if sp != s:
        pad = sp - s
        q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
        w = torch.nn.functional.pad(w, (0, 0, 0, pad))
        lo = torch.nn.functional.pad(lo, (0, pad))
        hi = torch.nn.functional.pad(hi, (0, pad))
        if cand is not None:
            cand = torch.nn.functional.pad(cand, (0, 0, 0, pad))
    kern = score_kernel(H, D, has_cand=cand is not None, **cfg)
    args = [q.contiguous(), k.contiguous(), w.contiguous(), lo.contiguous(), hi.contiguous()]
    if cand is not None:
        args.append(cand.contiguous().view(torch.int8))
    c = _chunks(sp // BQ * b, max(1, -(-n // cfg["BN"])), sm_count(q.device), chunks)
    out = kern(*args, _chunk_arg(c, q.device))
    return out[:, :s] if sp != s else out




# Run 10: stages=0 0.616 ms (release shape) / 0.232 (64 x 16K) against 0.750 / 0.346 with stages=2;
# run 11: dk entry blocks of 128 (BNk) 0.557 / 0.279 / 0.250 ms against 0.610 / 0.288 / 0.262 with 64.
BWD_CFG = dict(BQ=4, BN=64, threads=256, stages=0, BNk=128)
BWD_KERNEL = True       # False: dq, dk, dw by autograd of the torch reference on recomputed scores


def _score_bwd_torch(q, k, w, lo, hi, cand, dI):
    """The reference's autograd written out in torch ops (no autograd inside, so it also runs in a
    torch.func transform's backward): dS = (dI * w) * (q.k > 0) with dI zero where the score is -inf."""
    from ..reference_indexer import range_mask
    vis = range_mask(lo, hi, k.shape[1])
    if cand is not None:
        vis = vis & cand
    dI = dI.to(q.dtype).masked_fill(~vis, 0)[:, :, None, :]                      # [b, s, 1, n]
    sc = torch.einsum("bshd,bnd->bshn", q, k)                                    # [b, s, Hi, n]
    dw = (dI * sc.relu()).sum(-1)
    ds = (dI * w[..., None]) * (sc > 0)
    return torch.einsum("bshn,bnd->bshd", ds, k), torch.einsum("bshn,bshd->bnd", ds, q), dw


def _score_bwd(q, k, w, lo, hi, cand, dI, cfg=None, only=None):
    """dq, dk, dw of the scores: the two backward kernels (queries padded to BQ; padded rows see nothing).
    cfg: BQ, threads of both kernels; BN, stages and chunks of the dq / dw kernel (chunks > 1 splits
    the entries over CTAs and sums partial dq / dw with fp32 atomics; default by _chunks); BNk the
    entry block of the dk kernel (128 halves its q reloads; the dq kernel's three [M, BN] fp32 tiles
    do not fit registers at BN = 128). ``only`` = "q" / "k" runs one kernel (bench breakdown)."""
    if not BWD_KERNEL:
        return _score_bwd_torch(q, k, w, lo, hi, cand, dI)
    cfg = dict(BWD_CFG, **(cfg or {}))
    chunks = cfg.pop("chunks", None)        # entry chunks of the dq / dw kernel (default by _chunks)
    stages = cfg.pop("stages")              # K buffers of the dq / dw kernel
    BNk = cfg.pop("BNk")                    # entry block of the dk kernel
    b, s, H, D = q.shape
    n = k.shape[1]
    BQ, BN = cfg["BQ"], cfg["BN"]
    sp = -(-s // BQ) * BQ
    lo32, hi32 = lo.to(torch.int32), hi.to(torch.int32)
    qp, wp, dIp, cp = q, w, dI.to(torch.bfloat16), cand
    if sp != s:
        pad = sp - s
        F = torch.nn.functional
        qp, wp = F.pad(q, (0, 0, 0, 0, 0, pad)), F.pad(w, (0, 0, 0, pad))
        lo32, hi32 = F.pad(lo32, (0, pad)), F.pad(hi32, (0, pad))
        dIp = F.pad(dIp, (0, 0, 0, pad))
        cp = None if cand is None else F.pad(cand, (0, 0, 0, pad))
    args = [qp.contiguous(), k.contiguous(), wp.contiguous(), lo32.contiguous(), hi32.contiguous()]
    if cp is not None:
        args.append(cp.contiguous().view(torch.int8))
    args.append(dIp.contiguous())
    nblk = -(-n // BN)
    sms = sm_count(k.device)
    c = _chunks(sp // BQ * b, max(1, nblk), sms, chunks)
    qcfg = dict(BQ=BQ, BN=BN, threads=cfg["threads"], stages=stages)
    if only == "k":
        dq = dw = None
    elif c == 1:
        dq, dw = bwd_q_kernel(H, D, has_cand=cp is not None, **qcfg)(*args, _chunk_arg(1, k.device))
    else:       # few query blocks: entry chunks, partial dq / dw summed with fp32 atomics
        dq = torch.zeros(b, sp, H, D, dtype=torch.float32, device=q.device)
        dw = torch.zeros(b, sp, H, dtype=torch.float32, device=q.device)
        bwd_q_kernel(H, D, has_cand=cp is not None, split=True, **qcfg)(*args, _chunk_arg(c, k.device), dq, dw)
    if only == "q":
        return dq, None, dw
    dk = torch.zeros(b, n, D, dtype=torch.float32, device=k.device)
    P = max(1, min(sp // BQ, -(-2 * sms // max(1, -(-n // BNk) * b))))
    split = torch.empty(P, dtype=torch.int32, device=k.device)
    bwd_k_kernel(H, D, BQ=BQ, BN=BNk, has_cand=cp is not None, threads=cfg["threads"])(*args, split, dk)
    if only == "k":
        return None, dk, None
    return dq[:, :s].to(q.dtype), dk.to(k.dtype), dw[:, :s].to(w.dtype)


class _IndexScores(torch.autograd.Function):
    @staticmethod
    def forward(q, k, w, lo, hi, cand):
        return _score_fwd(q, k, w, lo, hi, cand)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, w, lo, hi, cand = inputs
        ctx.save_for_backward(q, k, w, lo, hi, cand)

    @staticmethod
    def backward(ctx, dI):
        q, k, w, lo, hi, cand = ctx.saved_tensors
        with torch._C._DisableFuncTorch():
            args = [None if t is None else _plain(t) for t in (q, k, w, lo, hi, cand, dI)]
            dq, dk, dw = _score_bwd(*args)
        return dq, dk, dw, None, None, None


def index_scores(q, k, w, lo, hi, cand=None):
    """Same contract as ``reference.index_scores``; bf16 operands with Di a multiple of 16 and
    BQ*Hi a multiple of 64 run the kernel, others (fp32 gradient-check models) the reference."""
    H, D = q.shape[2], q.shape[3]
    if not (q.dtype == k.dtype == w.dtype == torch.bfloat16) or D % 16 or (SCORE_CFG["BQ"] * H) % 64:
        from ..reference_indexer import index_scores as ref
        return ref(q, k, w, lo, hi, cand)
    return _IndexScores.apply(q, k, w, lo, hi, cand)
