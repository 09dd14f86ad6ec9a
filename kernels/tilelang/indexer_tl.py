"""Lightning indexer (SPEC §5) in TileLang for Hopper: fused scoring + visibility mask, exact top-k.

Scoring, ``I[b, t, j] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, j])`` over the visible range
``lo[b, t] <= j < hi[b, t]`` (and the candidate mask of level 2), -inf elsewhere. One CTA per
(BQ queries, batch row): the BQ*Hi (query, head) rows are the GEMM's M (BQ=4, Hi=32 -> 128), an entry
block of BN rows its N, Di its K. Entry blocks that lie wholly outside every query's range of the CTA
skip the GEMM and only store -inf (causal prefill: about half of them). Per block, as the reference
rounds: each dot product (fp32 accumulate) -> bf16, ReLU, times w -> bf16, then the sum over the Hi
heads in fp32 (through shared memory, heads in order) -> bf16. The fp32 sum order is the only
difference from torch (<= 1 bf16 ulp on a few outputs).

Top-k, per row: 16-bit order-preserving keys of the bf16 scores (-0 ties with +0, -inf never
selected), a two-pass 8-bit radix select for the threshold key K* and the number r of entries equal
to K* still needed, then an ordered compaction (per-thread contiguous segments + a block scan):
entries > K* and the first r entries == K* in index order. Output is therefore ascending, exactly the
reference's set (ties to the lower index), -1 padding after min(k, #finite) entries.

Candidate blocks (level 1) on plain rows: block maxima (torch amax, exact), the newest visible block
forced to +inf, and the same top-k kernel over the block scores (``index_candidates``).

Backward of the scores (``dq, dk, dw``): two kernels that recompute q.k per block (no [s, Hi, n]
tensor): dq and dw per query block in registers, dk per entry block with the query blocks split over
P CTAs and fp32 atomics (``BWD_KERNEL = False`` uses autograd of the torch reference instead).
"""

import functools

import torch
import tilelang.language as T

from ._common import compile_kernel

BF16, F32, I32 = "bfloat16", "float32", "int32"


# ----------------------------------------------------------------------------- scoring
@functools.lru_cache(maxsize=None)
def score_kernel(H: int, D: int, BQ: int = 4, BN: int = 128, has_cand: bool = False, threads: int = 256):
    """O = score(Q [B, S, H, D], K [B, N, D], W [B, S, H], Lo [B, S], Hi [B, S][, Cand [B, S, N] int8]).

    S a multiple of BQ (the launcher pads queries); N any (tails guarded)."""
    B, S, N = T.dynamic("B"), T.dynamic("S"), T.dynamic("N")
    M = BQ * H

    @T.macro
    def body(Q, K, W, Lo, Hi, Cand, O):
        with T.Kernel(S // BQ, B, threads=threads) as (qb, bi):
            q_s = T.alloc_shared([M, D], BF16)
            k_s = T.alloc_shared([BN, D], BF16)
            r_s = T.alloc_shared([M, BN], F32)
            w_f = T.alloc_fragment([M], F32)
            acc = T.alloc_fragment([M, BN], F32)
            lo_s = T.alloc_shared([BQ], I32)
            hi_s = T.alloc_shared([BQ], I32)
            jlo = T.alloc_var(I32)
            jhi = T.alloc_var(I32)

            q0 = qb * BQ
            for m, d in T.Parallel(M, D):
                q_s[m, d] = Q[bi, q0 + m // H, m % H, d]
            for m in T.Parallel(M):
                w_f[m] = T.Cast(F32, W[bi, q0 + m // H, m % H])
            for t in T.Parallel(BQ):
                lo_s[t] = Lo[bi, q0 + t]
                hi_s[t] = Hi[bi, q0 + t]
            jlo = N
            jhi = 0
            for t in T.serial(BQ):
                if lo_s[t] < hi_s[t]:
                    jlo = T.min(jlo, lo_s[t])
                    jhi = T.max(jhi, hi_s[t])

            for nb in T.serial(T.ceildiv(N, BN)):
                j0 = nb * BN
                if j0 < jhi and j0 + BN > jlo:
                    for j, d in T.Parallel(BN, D):
                        k_s[j, d] = T.if_then_else(j0 + j < N, K[bi, j0 + j, d], T.Cast(BF16, 0))
                    T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
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
                else:
                    for t, j in T.Parallel(BQ, BN):
                        if j0 + j < N:
                            O[bi, q0 + t, j0 + j] = -T.infinity(BF16)

    if has_cand:
        @T.prim_func
        def index_score_cand(
            Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
            Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32), Cand: T.Tensor([B, S, N], "int8"),
            O: T.Tensor([B, S, N], BF16),
        ):
            body(Q, K, W, Lo, Hi, Cand, O)
        return compile_kernel(index_score_cand, out_idx=[6])

    @T.prim_func
    def index_score(
        Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
        Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32),
        O: T.Tensor([B, S, N], BF16),
    ):
        body(Q, K, W, Lo, Hi, None, O)
    return compile_kernel(index_score, out_idx=[5])


# ----------------------------------------------------------------------------- top-k
@functools.lru_cache(maxsize=None)
def topk_kernel(KT: int, threads: int = 512):
    """Idx [R, KT] int32 = exact top-KT of each row of X [R, N] bf16 (ascending, -1 padding)."""
    R, N = T.dynamic("R"), T.dynamic("N")
    NT = threads

    @T.macro
    def key_of(x):
        # order-preserving 16-bit key of a bf16 (as int32 0..65535); -0 maps onto +0
        u = T.Cast(I32, T.reinterpret("uint16", x))
        u0 = T.if_then_else(u == 0x8000, 0, u)
        return T.if_then_else(u0 >= 0x8000, 0xFFFF - u0, u0 + 0x8000)

    @T.prim_func
    def index_topk(X: T.Tensor([R, N], BF16), Idx: T.Tensor([R, KT], I32)):
        with T.Kernel(R, threads=NT) as row:
            tx = T.get_thread_binding()
            hist = T.alloc_shared([257], I32)
            scan = T.alloc_shared([2 * NT], I32)
            info = T.alloc_shared([4], I32)        # nvalid, threshold key, ties to take, -
            kk = T.alloc_var(I32)
            rem = T.alloc_var(I32)
            b1 = T.alloc_var(I32)
            thr = T.alloc_var(I32)
            ntie = T.alloc_var(I32)
            cgt = T.alloc_var(I32)
            ctie = T.alloc_var(I32)
            pos = T.alloc_var(I32)
            v = T.alloc_var(I32)
            key = T.alloc_var(I32)
            seg = T.ceildiv(N, NT)

            # pass 1: histogram of the high byte of the keys of finite entries (-inf key = 0x007F)
            for i in T.serial(T.ceildiv(257, NT)):
                if i * NT + tx < 257:
                    hist[i * NT + tx] = 0
            if tx == 0:
                info[0] = 0
                info[1] = 0
                info[2] = 0
            T.sync_threads()
            for it in T.serial(T.ceildiv(N, NT)):
                j = it * NT + tx
                if j < N:
                    key = key_of(X[row, j])
                    if key != 0x007F:
                        T.atomic_add(hist[key >> 8], 1)
            T.sync_threads()
            # suffix sums over the 256 bins (hist[256] = 0): hist[b] = #(high byte >= b)
            for step in T.serial(8):
                if tx < 256:
                    v = hist[tx] + T.if_then_else(tx + (1 << step) < 256, hist[tx + (1 << step)], 0)
                T.sync_threads()
                if tx < 256:
                    hist[tx] = v
                T.sync_threads()
            kk = T.min(KT, hist[0])
            if tx < 256:
                if kk > 0 and hist[tx] >= kk and hist[tx + 1] < kk:
                    info[1] = tx
            T.sync_threads()
            b1 = info[1]
            rem = kk - hist[b1 + 1]
            T.sync_threads()
            # pass 2: low byte among entries whose high byte is b1
            for i in T.serial(T.ceildiv(257, NT)):
                if i * NT + tx < 257:
                    hist[i * NT + tx] = 0
            T.sync_threads()
            if kk > 0:
                for it in T.serial(T.ceildiv(N, NT)):
                    j = it * NT + tx
                    if j < N:
                        key = key_of(X[row, j])
                        if key != 0x007F and (key >> 8) == b1:
                            T.atomic_add(hist[key & 0xFF], 1)
            T.sync_threads()
            for step in T.serial(8):
                if tx < 256:
                    v = hist[tx] + T.if_then_else(tx + (1 << step) < 256, hist[tx + (1 << step)], 0)
                T.sync_threads()
                if tx < 256:
                    hist[tx] = v
                T.sync_threads()
            if tx < 256:
                if kk > 0 and hist[tx] >= rem and hist[tx + 1] < rem:
                    info[2] = tx
            T.sync_threads()
            thr = b1 * 256 + info[2]
            ntie = rem - hist[info[2] + 1]             # entries equal to the threshold key to take
            # pass 3: ordered compaction over contiguous segments of `seg` entries per thread
            cgt = 0
            ctie = 0
            if kk > 0:
                for e in T.serial(seg):
                    j = tx * seg + e
                    if j < N:
                        key = key_of(X[row, j])
                        if key != 0x007F:
                            if key > thr:
                                cgt += 1
                            if key == thr:
                                ctie += 1
            scan[tx] = cgt
            scan[NT + tx] = ctie
            T.sync_threads()
            # inclusive Hillis-Steele scans of both counts
            off = T.alloc_var(I32)
            a = T.alloc_var(I32)
            c = T.alloc_var(I32)
            off = 1
            while off < NT:
                a = scan[tx] + T.if_then_else(tx >= off, scan[T.max(tx - off, 0)], 0)
                c = scan[NT + tx] + T.if_then_else(tx >= off, scan[NT + T.max(tx - off, 0)], 0)
                T.sync_threads()
                scan[tx] = a
                scan[NT + tx] = c
                T.sync_threads()
                off = off * 2
            cgt = scan[tx] - cgt                      # exclusive: before this thread's segment
            ctie = scan[NT + tx] - ctie
            if kk > 0:
                for e in T.serial(seg):
                    j = tx * seg + e
                    if j < N:
                        key = key_of(X[row, j])
                        if key != 0x007F:
                            if key > thr:
                                Idx[row, cgt + T.min(ctie, ntie)] = j
                                cgt += 1
                            if key == thr:
                                if ctie < ntie:
                                    Idx[row, cgt + ctie] = j
                                ctie += 1
            for i in T.serial(T.ceildiv(KT, NT)):
                p = i * NT + tx
                if p < KT and p >= kk:
                    Idx[row, p] = -1

    return compile_kernel(index_topk, out_idx=[1])


# ----------------------------------------------------------------------------- backward of the scores
# dS[t, h, j] = bf16(dI[t, j] * w[t, h]) * (q.k > 0) (as the reference's autograd rounds it), with dI
# zeroed outside the visible range / candidates; dq = dS k, dk = dS^T q, dw[t, h] = sum_j dI ReLU(q.k).
# q.k is recomputed per block (no [s, Hi, n] tensor). Two kernels: one over query blocks (dq, dw, in
# registers), one over entry blocks (dk in registers, query blocks split over P CTAs + fp32 atomics).
@functools.lru_cache(maxsize=None)
def bwd_q_kernel(H: int, D: int, BQ: int = 4, BN: int = 64, has_cand: bool = False, threads: int = 256):
    """dQ [B, S, H, D] bf16, dW [B, S, H] fp32 = bwd_q(Q, K, W, Lo, Hi[, Cand], dI); S a multiple of BQ."""
    B, S, N = T.dynamic("B"), T.dynamic("S"), T.dynamic("N")
    M = BQ * H

    @T.macro
    def body(Q, K, W, Lo, Hi, Cand, dI, dQ, dW):
        with T.Kernel(S // BQ, B, threads=threads) as (qb, bi):
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

            q0 = qb * BQ
            for m, d in T.Parallel(M, D):
                q_s[m, d] = Q[bi, q0 + m // H, m % H, d]
            for m in T.Parallel(M):
                w_f[m] = T.Cast(F32, W[bi, q0 + m // H, m % H])
            for t in T.Parallel(BQ):
                lo_s[t] = Lo[bi, q0 + t]
                hi_s[t] = Hi[bi, q0 + t]
            T.clear(dq)
            T.clear(dw_f)
            jlo = N
            jhi = 0
            for t in T.serial(BQ):
                if lo_s[t] < hi_s[t]:
                    jlo = T.min(jlo, lo_s[t])
                    jhi = T.max(jhi, hi_s[t])
            for nb in T.serial(T.ceildiv(N, BN)):
                j0 = nb * BN
                if j0 < jhi and j0 + BN > jlo:
                    for j, d in T.Parallel(BN, D):
                        k_s[j, d] = T.if_then_else(j0 + j < N, K[bi, j0 + j, d], T.Cast(BF16, 0))
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
            for m, d in T.Parallel(M, D):
                dQ[bi, q0 + m // H, m % H, d] = T.Cast(BF16, dq[m, d])
            for m in T.Parallel(M):
                dW[bi, q0 + m // H, m % H] = dw_f[m]

    if has_cand:
        @T.prim_func
        def index_score_bwd_q_cand(
            Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
            Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32), Cand: T.Tensor([B, S, N], "int8"),
            dI: T.Tensor([B, S, N], BF16), dQ: T.Tensor([B, S, H, D], BF16), dW: T.Tensor([B, S, H], F32),
        ):
            body(Q, K, W, Lo, Hi, Cand, dI, dQ, dW)
        return compile_kernel(index_score_bwd_q_cand, out_idx=[7, 8])

    @T.prim_func
    def index_score_bwd_q(
        Q: T.Tensor([B, S, H, D], BF16), K: T.Tensor([B, N, D], BF16), W: T.Tensor([B, S, H], BF16),
        Lo: T.Tensor([B, S], I32), Hi: T.Tensor([B, S], I32),
        dI: T.Tensor([B, S, N], BF16), dQ: T.Tensor([B, S, H, D], BF16), dW: T.Tensor([B, S, H], F32),
    ):
        body(Q, K, W, Lo, Hi, None, dI, dQ, dW)
    return compile_kernel(index_score_bwd_q, out_idx=[6, 7])


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
SCORE_CFG = dict(BQ=4, BN=128, threads=256)
TOPK_THREADS = 512


def _score_fwd(q, k, w, lo, hi, cand=None, cfg=None):
    """Launch the scoring kernel: pads the queries to a multiple of BQ (padded rows see nothing)."""
    cfg = dict(SCORE_CFG, **(cfg or {}))
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
    out = kern(*args)
    return out[:, :s] if sp != s else out


def _plain(t):
    from torch._C import _functorch as F
    while F.is_functorch_wrapped_tensor(t):
        t = F.get_unwrapped(t)
    return t


BWD_CFG = dict(BQ=4, BN=64, threads=256)
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


def _score_bwd(q, k, w, lo, hi, cand, dI, cfg=None):
    """dq, dk, dw of the scores: the two backward kernels (queries padded to BQ; padded rows see nothing)."""
    if not BWD_KERNEL:
        return _score_bwd_torch(q, k, w, lo, hi, cand, dI)
    cfg = dict(BWD_CFG, **(cfg or {}))
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
    dq, dw = bwd_q_kernel(H, D, has_cand=cp is not None, **cfg)(*args)
    dk = torch.zeros(b, n, D, dtype=torch.float32, device=k.device)
    nblk = -(-n // BN)
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    P = max(1, min(sp // BQ, -(-2 * sms // max(1, nblk * b))))
    split = torch.empty(P, dtype=torch.int32, device=k.device)
    bwd_k_kernel(H, D, has_cand=cp is not None, **cfg)(*args, split, dk)
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


def index_topk(score, k, threads=None):
    """Same contract as ``reference.index_topk`` (int64 ids ascending, -1 padding; exact ties to the
    lower index). One kernel per requested k: rows shorter than k take the first n columns."""
    n = score.shape[-1]
    kk = min(k, n)
    lead = score.shape[:-1]
    if kk == 0:
        return score.new_zeros(lead + (0,), dtype=torch.int64)
    if score.dtype != torch.bfloat16:
        from ..reference_indexer import index_topk as ref
        return ref(score, k)
    x = score.reshape(-1, n).contiguous()
    idx = topk_kernel(int(k), threads or TOPK_THREADS)(x)
    return idx[:, :kk].long().reshape(lead + (kk,))


def index_candidates(score, lo, hi, blocks, n_blocks, topk_blocks, threads=None):
    """Level-1 candidate blocks. Plain rows (``blocks`` an int block size): block maxima by a torch amax
    (exact: a max of bf16 values), the newest visible entry's block set to +inf, then the top-k kernel
    over the [b*s, n_blocks] block scores (same exact rule: ties to the lower block id, -inf never
    kept), expanded back to entries. Packed rows (a [b, n] block-id tensor): the torch reference."""
    b, s, n = score.shape
    if not isinstance(blocks, int) or score.dtype != torch.bfloat16 or n == 0:
        from ..reference_indexer import index_candidates as ref
        return ref(score, lo, hi, blocks, n_blocks, topk_blocks)
    B, nb = blocks, n_blocks
    x = score
    if nb * B != n:
        x = torch.nn.functional.pad(x, (0, nb * B - n), value=float("-inf"))
    bs = x.view(b, s, nb, B).amax(-1)                                            # [b, s, nb] bf16
    has = hi > lo
    fb = torch.where(has, hi - 1, 0) // B
    forced = torch.nn.functional.one_hot(fb, nb).bool() & has[..., None]
    bs = bs.masked_fill(forced, float("inf")).reshape(b * s, nb).contiguous()
    kb = min(topk_blocks, nb)
    idx = topk_kernel(int(topk_blocks), threads or TOPK_THREADS)(bs)[:, :kb].long()
    keep = torch.zeros(b * s, nb + 1, dtype=torch.bool, device=score.device)
    keep.scatter_(1, torch.where(idx >= 0, idx, nb), True)
    return keep[:, :nb].view(b, s, nb).repeat_interleave(B, -1)[..., :n]
