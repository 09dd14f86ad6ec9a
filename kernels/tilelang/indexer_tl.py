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

Backward of the scores (``dq, dk, dw``) is computed by the torch reference's autograd on recomputed
scores for now (``_IndexScores.backward``); a fused kernel is the next step.
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


def _score_bwd(q, k, w, lo, hi, cand, dI):
    """dq, dk, dw by autograd of the torch reference on recomputed scores (a fused kernel is next)."""
    from ..reference_indexer import index_scores as ref
    with torch.enable_grad():
        qd, kd, wd = (t.detach().requires_grad_(True) for t in (q, k, w))
        out = ref(qd, kd, wd, lo, hi, cand)
        return torch.autograd.grad(out, (qd, kd, wd), dI)


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


def index_candidates(score, lo, hi, blocks, n_blocks, topk_blocks):
    """Level-1 candidate blocks: the torch reference's ops on the GPU for now (no TileLang kernel yet)."""
    from ..reference_indexer import index_candidates as ref
    return ref(score, lo, hi, blocks, n_blocks, topk_blocks)
