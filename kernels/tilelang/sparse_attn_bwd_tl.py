"""Sparse attention backward split in two kernels (issue #7 item 1): dq over queries, dkv over (query, slot).

Shapes: q, o, do [B, M, H, D] bf16, kv [B, N, D] bf16 (K = V), idx [B, M, TP] int32 (-1 holes, TP a
multiple of BI), lse / delta [B, M, H] fp32 (lse in log2 units of the scaled logits, as the forward
writes it; delta = dO . O). Math as in ``sparse_attn_tl`` (the single-kernel "atomic" backward).

1. ``dq_kernel`` — one CTA per (query, <= 64 heads), 3 GEMMs per index block: S = q kv^T,
   dP = dO kv^T, dq += dS kv, with P = exp2(c S - LSE) and dS = scale * P * (dP - Delta). It also writes
   P and dS as bf16 to global [B, M, H, TP] (the same bf16 values the single kernel feeds its dkv GEMMs,
   so the numerics are unchanged). Without the dkv GEMMs and their [BI, D/DS] accumulator the kernel
   keeps only dq (BH x D fp32) and two BH x BI tiles in registers.
   Bytes: 2 x M*H*TP*2 = 671 MB written at the release shape (~0.15 ms at H200 bandwidth).

2. ``dkv_kernel`` — one CTA per (query, D chunk of DC columns): q[m] and dO[m] (its DC columns) stay in
   shared memory; for each index block it reads the P / dS tiles back, forms
   dkv_blk[BI, DC] = dS^T q + P^T dO (two GEMMs, K = heads) and adds the rows into the fp32 dkv buffer
   from a shared staging tile with 16-byte vector atomics (red.global.add.v4.f32), skipping holes.
   Same number of atomic adds as the single kernel, but 4 floats per instruction instead of 2, rows
   contiguous, and the adds overlap other CTAs' GEMMs (2 CTAs/SM at DC=128).

3. Window fast path (``bwd_split`` cfg ``window=W``, the caller's promise that slots [0, W) are a
   sliding window: row m - W + 1 + t + base or -1; checked on the device, one host sync, unless
   ``win_check=False``): the dq kernel writes those slots' P / dS shifted by m % BQ into [.., W + BQ]
   buffers and ``dkv_window_kernel`` sums BQ = 64 consecutive queries in registers (they share
   W - 1 of their W rows) with one atomic per row at the end; ``dkv_kernel(t0=W)`` does the rest.
   ``fuse_delta`` (window variant only): the dq kernel computes delta itself (no delta kernel).
   The model's window layout (valid slots first, so queries before position W - 1 differ) does not
   pass the check; only the bench / release-shaped index lists use it for now.

Why not a CSR kernel over kv rows without atomics: dkv[n] = sum over the (m, t) that use row n of
dS[m, :, t] . q[m] — the reduction for one row runs over heads of *different* queries, so a row's GEMM
has M = 1 and must stream q[m], dO[m] (128 KB) per use: 2.36 M uses x 128 KB = 300 GB at the release
shape. Grouping rows only helps where rows share their users: window rows do (each block of 64
consecutive rows is used by 191 consecutive queries, 67% dense), the top-k compressed rows (80% of the
slots) do not (each query picks 512 of <= 2048 at random, 25% density). So the per-query GEMM
(K = heads) plus a reduction across queries is the structure; this file makes that reduction cheaper.
"""
import functools

import tilelang
import tilelang.language as T
import torch

from ._common import LOG2E, compile_kernel

BF16, F32, I32 = "bfloat16", "float32", "int32"


def _head_block(H: int) -> int:
    bh = min(H, 64)
    if H % bh or bh % 16:
        raise ValueError(f"sparse_attn (tilelang): heads {H} must be a multiple of 16 (<= 64) or of 64")
    return bh


@functools.lru_cache(maxsize=None)
def dq_kernel(H: int, D: int, TP: int, scale: float, BI: int = 64, stages: int = 1, threads: int = 256,
              window: int = 0, BQ: int = 64, fuse_delta: bool = False):
    """dq, P, dS = dq_kernel(q, kv, do, idx, lse, delta); P, dS bf16 [B, M, H, TP] (0 at holes).

    threads 256: two warpgroups split every GEMM's N (dq [64, 512] fp32 = 128 registers a thread;
    ptxas: 240 registers at stages 0, 255 + 472 B of spills at stages 1); threads 512: four warpgroups,
    dq 64 registers a thread, narrower (n16) QK / dP WGMMAs.
    window W > 0 (a multiple of BI): dq, P, dS = dq_kernel(q, kv, do, idx, lse, delta, Pw, dSw): the
    window slots' P / dS go to Pw / dSw [B, MP, H, W + BQ] instead, shifted by s = m % BQ lines
    (Pw[m, h, s + t] = P[m, h, t], zeros on the other lines) for ``dkv_window_kernel``; P / dS
    columns [0, W) are then left unwritten. The shifted stores are scalar (s is any offset).
    The window variant takes o too: dq_kernel(q, kv, do, o, idx, lse, delta, Pw, dSw); with
    fuse_delta it computes delta = rowsum(dO * O) itself (dO is in shared memory already; saves the
    delta kernel's second read of dO, 268 MB at the release shape) and writes it into ``delta``."""
    if window:
        return _dq_window_kernel(H, D, TP, scale, BI, stages, threads, window, BQ, fuse_delta)
    if fuse_delta:
        raise ValueError("dq_kernel: fuse_delta needs window > 0 (the window variant's signature)")
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    BH = _head_block(H)
    NI = TP // BI
    c = float(scale) * LOG2E

    @T.prim_func
    def sparse_attn_bwd_dq(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        dO: T.Tensor([B, M, H, D], BF16),
        Idx: T.Tensor([B, M, TP], I32),
        Lse: T.Tensor([B, M, H], F32),
        Delta: T.Tensor([B, M, H], F32),
        dQ: T.Tensor([B, M, H, D], BF16),
        P: T.Tensor([B, M, H, TP], BF16),
        dS: T.Tensor([B, M, H, TP], BF16),
    ):
        with T.Kernel(M, H // BH, B, threads=threads) as (mi, hb, bi):
            q_s = T.alloc_shared([BH, D], BF16)
            do_s = T.alloc_shared([BH, D], BF16)
            kv_s = T.alloc_shared([BI, D], BF16)
            p_s = T.alloc_shared([BH, BI], BF16)
            ds_s = T.alloc_shared([BH, BI], BF16)
            valid = T.alloc_fragment([BI], "bool")
            acc_p = T.alloc_fragment([BH, BI], F32)
            acc_dp = T.alloc_fragment([BH, BI], F32)
            acc_dq = T.alloc_fragment([BH, D], F32)
            lse = T.alloc_fragment([BH], F32)
            delta = T.alloc_fragment([BH], F32)

            h0 = hb * BH
            T.copy(Q[bi, mi, h0:h0 + BH, :], q_s)
            T.copy(dO[bi, mi, h0:h0 + BH, :], do_s)
            T.copy(Lse[bi, mi, h0:h0 + BH], lse)
            T.copy(Delta[bi, mi, h0:h0 + BH], delta)
            T.clear(acc_dq)

            for it in T.Pipelined(NI, num_stages=stages):
                for t in T.Parallel(BI):
                    valid[t] = Idx[bi, mi, it * BI + t] >= 0
                for t, d in T.Parallel(BI, D):
                    kv_s[t, d] = KV[bi, T.max(Idx[bi, mi, it * BI + t], 0), d]
                for h, t in T.Parallel(BH, BI):
                    acc_p[h, t] = T.if_then_else(valid[t], 0, -T.infinity(F32))
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                for h, t in T.Parallel(BH, BI):
                    acc_p[h, t] = T.exp2(acc_p[h, t] * c - lse[h])
                for h, t in T.Parallel(BH, BI):
                    acc_dp[h, t] = acc_p[h, t] * (acc_dp[h, t] - delta[h]) * scale
                T.copy(acc_p, p_s)
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                T.copy(p_s, P[bi, mi, h0:h0 + BH, it * BI:(it + 1) * BI])
                T.copy(ds_s, dS[bi, mi, h0:h0 + BH, it * BI:(it + 1) * BI])

            T.copy(acc_dq, q_s)
            T.copy(q_s, dQ[bi, mi, h0:h0 + BH, :])

    return compile_kernel(sparse_attn_bwd_dq, out_idx=[6, 7, 8])


@functools.lru_cache(maxsize=None)
def _dq_window_kernel(H: int, D: int, TP: int, scale: float, BI: int, stages: int, threads: int, W: int, BQ: int,
                      fuse_delta: bool):
    """``dq_kernel`` with the window slots' P / dS written shifted to Pw / dSw (see there)."""
    B, M, MP, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("MP"), T.dynamic("N")
    BH = _head_block(H)
    NI = TP // BI
    LW = W + BQ
    DCH = 64                                                          # delta: O read in D chunks of 64
    c = float(scale) * LOG2E
    if W % BI or W > TP:
        raise ValueError(f"dq_kernel: window {W} must be a multiple of BI {BI} and <= TP {TP}")

    @T.prim_func
    def sparse_attn_bwd_dq_window(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        dO: T.Tensor([B, M, H, D], BF16),
        O: T.Tensor([B, M, H, D], BF16),
        Idx: T.Tensor([B, M, TP], I32),
        Lse: T.Tensor([B, M, H], F32),
        Delta: T.Tensor([B, M, H], F32),
        Pw: T.Tensor([B, MP, H, LW], BF16),
        dSw: T.Tensor([B, MP, H, LW], BF16),
        dQ: T.Tensor([B, M, H, D], BF16),
        P: T.Tensor([B, M, H, TP], BF16),
        dS: T.Tensor([B, M, H, TP], BF16),
    ):
        with T.Kernel(M, H // BH, B, threads=threads) as (mi, hb, bi):
            q_s = T.alloc_shared([BH, D], BF16)
            do_s = T.alloc_shared([BH, D], BF16)
            kv_s = T.alloc_shared([BI, D], BF16)
            p_s = T.alloc_shared([BH, BI], BF16)
            ds_s = T.alloc_shared([BH, BI], BF16)
            valid = T.alloc_fragment([BI], "bool")
            acc_p = T.alloc_fragment([BH, BI], F32)
            acc_dp = T.alloc_fragment([BH, BI], F32)
            acc_dq = T.alloc_fragment([BH, D], F32)
            lse = T.alloc_fragment([BH], F32)
            delta = T.alloc_fragment([BH], F32)

            h0 = hb * BH
            sh = mi % BQ                                              # this query's line shift
            T.copy(Q[bi, mi, h0:h0 + BH, :], q_s)
            T.copy(dO[bi, mi, h0:h0 + BH, :], do_s)
            T.copy(Lse[bi, mi, h0:h0 + BH], lse)
            if fuse_delta:
                dacc = T.alloc_fragment([BH, DCH], F32)
                dsum = T.alloc_fragment([BH], F32)
                dsum_s = T.alloc_shared([BH], F32)                    # re-layout: reduce -> delta
                T.clear(dacc)
                for kc in T.serial(D // DCH):
                    for h, d in T.Parallel(BH, DCH):
                        dacc[h, d] += T.cast(O[bi, mi, h0 + h, kc * DCH + d], F32) * T.cast(do_s[h, kc * DCH + d], F32)
                T.reduce_sum(dacc, dsum, dim=1)
                T.copy(dsum, dsum_s)
                T.copy(dsum_s, delta)
                T.copy(dsum_s, Delta[bi, mi, h0:h0 + BH])
            else:
                T.copy(Delta[bi, mi, h0:h0 + BH], delta)
            T.clear(acc_dq)
            for h, l in T.Parallel(BH, LW):                           # the lines no slot lands on
                if l < sh or l >= sh + W:
                    Pw[bi, mi, h0 + h, l] = T.cast(0, BF16)
                    dSw[bi, mi, h0 + h, l] = T.cast(0, BF16)

            for it in T.Pipelined(NI, num_stages=stages):
                for t in T.Parallel(BI):
                    valid[t] = Idx[bi, mi, it * BI + t] >= 0
                for t, d in T.Parallel(BI, D):
                    kv_s[t, d] = KV[bi, T.max(Idx[bi, mi, it * BI + t], 0), d]
                for h, t in T.Parallel(BH, BI):
                    acc_p[h, t] = T.if_then_else(valid[t], 0, -T.infinity(F32))
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                for h, t in T.Parallel(BH, BI):
                    acc_p[h, t] = T.exp2(acc_p[h, t] * c - lse[h])
                for h, t in T.Parallel(BH, BI):
                    acc_dp[h, t] = acc_p[h, t] * (acc_dp[h, t] - delta[h]) * scale
                T.copy(acc_p, p_s)
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                if it * BI < W:
                    for h, t in T.Parallel(BH, BI):
                        Pw[bi, mi, h0 + h, sh + it * BI + t] = p_s[h, t]
                        dSw[bi, mi, h0 + h, sh + it * BI + t] = ds_s[h, t]
                else:
                    T.copy(p_s, P[bi, mi, h0:h0 + BH, it * BI:(it + 1) * BI])
                    T.copy(ds_s, dS[bi, mi, h0:h0 + BH, it * BI:(it + 1) * BI])

            T.copy(acc_dq, q_s)
            T.copy(q_s, dQ[bi, mi, h0:h0 + BH, :])

    return compile_kernel(sparse_attn_bwd_dq_window, out_idx=[9, 10, 11])


@functools.lru_cache(maxsize=None)
def dkv_kernel(H: int, D: int, TP: int, BI: int = 64, DC: int = 128, stages: int = 2, threads: int = 128,
               ws: bool = False, pad: int = 8, t0: int = 0):
    """dkv_kernel(q, do, idx, P, dS, dkv_acc): dkv_acc (fp32 [B, N, D]) += dS^T q + P^T dO per used row.

    One CTA per (D chunk, query, batch); the chunk index runs fastest so the D/DC CTAs of one query
    (which read the same P / dS tiles) are resident together and share them through L2.
    ws=False (default) turns TileLang's automatic warp specialisation off: with it, a TMA producer
    warpgroup is added and launch_bounds(256) reserves 168+ registers a thread, one CTA per SM; without
    it, DC=128 / 128 threads needs ~100 registers and 96 KB of shared memory, two CTAs per SM, so one
    CTA's atomics drain while the other runs its GEMMs.
    pad: extra fp32 columns of the staging tile's rows. The accumulator fragment is stored as float2
    per thread, 8 rows per warp; with a 128-float (512 B) row stride those 8 rows fall on the same
    banks (8-way conflicts on 32 KB of stores per block); 8 floats of padding spread them.
    t0: first slot handled (a multiple of BI); slots [0, t0) are left to ``dkv_window_kernel``."""
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if t0 % BI or t0 >= TP:
        raise ValueError(f"dkv_kernel: t0 {t0} must be a multiple of BI {BI} below TP {TP}")
    NI = (TP - t0) // BI
    if D % DC or DC % 4:
        raise ValueError(f"dkv_kernel: D {D} must be a multiple of DC {DC} (a multiple of 4)")

    @T.prim_func
    def sparse_attn_bwd_dkv(
        Q: T.Tensor([B, M, H, D], BF16),
        dO: T.Tensor([B, M, H, D], BF16),
        Idx: T.Tensor([B, M, TP], I32),
        P: T.Tensor([B, M, H, TP], BF16),
        dS: T.Tensor([B, M, H, TP], BF16),
        dKV: T.Tensor([B, N, D], F32),
    ):
        with T.Kernel(D // DC, M, B, threads=threads) as (dc, mi, bi):
            q_s = T.alloc_shared([H, DC], BF16)
            do_s = T.alloc_shared([H, DC], BF16)
            p_s = T.alloc_shared([H, BI], BF16)
            ds_s = T.alloc_shared([H, BI], BF16)
            stage = T.alloc_shared([BI, DC + pad], F32)
            acc = T.alloc_fragment([BI, DC], F32)

            d0 = dc * DC
            T.copy(Q[bi, mi, :, d0:d0 + DC], q_s)
            T.copy(dO[bi, mi, :, d0:d0 + DC], do_s)
            for it in T.Pipelined(NI, num_stages=stages):
                T.copy(P[bi, mi, :, t0 + it * BI:t0 + (it + 1) * BI], p_s)
                T.copy(dS[bi, mi, :, t0 + it * BI:t0 + (it + 1) * BI], ds_s)
                T.gemm(ds_s, q_s, acc, transpose_A=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                T.gemm(p_s, do_s, acc, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(acc, stage[:, 0:DC])
                for t, j in T.Parallel(BI, DC // 4):
                    if Idx[bi, mi, t0 + it * BI + t] >= 0:
                        T.atomic_addx4(dKV[bi, Idx[bi, mi, t0 + it * BI + t], d0 + j * 4], stage[t, j * 4])

    cfg = {} if ws else {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    return compile_kernel(sparse_attn_bwd_dkv, pass_configs=cfg)


@functools.lru_cache(maxsize=None)
def dkv_window_kernel(H: int, D: int, W: int = 128, BQ: int = 64, base: int = 0, DC: int = 64, stages: int = 2,
                      threads: int = 384):
    """dkv_window_kernel(q, do, Pw, dSw, dkv_acc): the dkv contributions of the W window slots.

    Window layout (the caller's promise, ``bwd_split(window=W)``): slot t < W of query m names row
    m - W + 1 + t + base, or -1 (as the bench builds it: -1 before position 0). BQ consecutive
    queries m0 .. m0 + BQ - 1 then read the W + BQ - 1 rows rb = m0 - W + 1 + base .. m0 + BQ - 1 + base,
    and query m = m0 + s reads them at lines s .. s + W - 1. ``dq_kernel(window=W)`` writes its window
    P / dS already shifted: Pw[b, m, h, s + t] = P[b, m, h, t], zero on the other lines, LW = W + BQ
    lines. So the BQ queries' contributions are ONE accumulation in registers,
        acc[LW, DC] += Pw[m]^T dO[m] + dSw[m]^T q[m]        (K = heads, m over the BQ queries),
    and one atomic add per row and column at the end: (W + BQ - 1) / BQ = 3 row-adds per query at
    W = 128, BQ = 64, instead of W = 128 in dkv_kernel (the fp32 atomics are what limit that kernel).
    The price: GEMM M = LW instead of W (1.5x the window FLOPs at BQ = 64; the zero lines), and each
    of the D / DC CTAs of a query block reads Pw / dSw (L2).
    Pw / dSw: [B, MP, H, LW] bf16, MP = M rounded up to BQ with zero rows past M (so the last CTA's
    missing queries add nothing; q / dO are read at a clamped row for them).
    threads 384: three warpgroups, one m64 slice of LW = 192 each (acc = LW * DC / threads fp32 a thread)."""
    B, M, MP, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("MP"), T.dynamic("N")
    LW = W + BQ
    if D % DC or LW % 64:
        raise ValueError(f"dkv_window_kernel: need DC | D and 64 | W + BQ; got D={D} DC={DC} W={W} BQ={BQ}")

    @T.prim_func
    def sparse_attn_bwd_dkv_window(
        Q: T.Tensor([B, M, H, D], BF16),
        dO: T.Tensor([B, M, H, D], BF16),
        Pw: T.Tensor([B, MP, H, LW], BF16),
        dSw: T.Tensor([B, MP, H, LW], BF16),
        dKV: T.Tensor([B, N, D], F32),
    ):
        with T.Kernel(D // DC, T.ceildiv(M, BQ), B, threads=threads) as (dc, qb, bi):
            q_s = T.alloc_shared([H, DC], BF16)
            do_s = T.alloc_shared([H, DC], BF16)
            p_s = T.alloc_shared([H, LW], BF16)
            ds_s = T.alloc_shared([H, LW], BF16)
            acc = T.alloc_fragment([LW, DC], F32)

            d0 = dc * DC
            m0 = qb * BQ
            rb = m0 - (W - 1) + base                                  # row of line 0
            T.clear(acc)
            for k in T.Pipelined(BQ, num_stages=stages):
                T.copy(Q[bi, T.min(m0 + k, M - 1), :, d0:d0 + DC], q_s)
                T.copy(dO[bi, T.min(m0 + k, M - 1), :, d0:d0 + DC], do_s)
                T.copy(Pw[bi, m0 + k, :, :], p_s)
                T.copy(dSw[bi, m0 + k, :, :], ds_s)
                T.gemm(ds_s, q_s, acc, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(p_s, do_s, acc, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
            for l, j in T.Parallel(LW, DC):                           # line LW - 1 is never written (0)
                if rb + l >= 0 and rb + l < N and l < LW - 1:
                    T.atomic_add(dKV[bi, rb + l, d0 + j], acc[l, j])

    return compile_kernel(sparse_attn_bwd_dkv_window,
                          pass_configs={tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True})


# ----------------------------------------------------------------------------- launch helpers
# BI: the dq kernel's index block; dkv_BI: the dkv kernel's (its GEMM M; it reads P / dS back from
# global memory, so the two need not match; both must divide 128, the padding of idx).
# window: W > 0 is the caller's promise that slots [0, W) are a sliding window (see dkv_window_kernel;
# checked on the device unless win_check=False); those slots then go through dkv_window_kernel with
# the win_* knobs, the rest through dkv_kernel (t0 = W).
DEFAULT_CFG = dict(BI=64, dq_stages=1, dq_threads=256, dkv_BI=64, DC=128, dkv_stages=2, dkv_threads=128, dkv_ws=False,
                   dkv_pad=8, window=0, win_base=0, win_BQ=64, win_DC=64, win_stages=2, win_threads=384, win_check=True,
                   fuse_delta=False)


def check_window(idx, W: int, base: int = 0) -> bool:
    """True if every slot t < W of query m is -1 or row m - W + 1 + t + base (one host sync)."""
    M = idx.shape[1]
    m = torch.arange(M, device=idx.device)[:, None]
    exp = m - W + 1 + base + torch.arange(W, device=idx.device)[None]
    w = idx[..., :W]
    return bool(((w == exp) | (w < 0)).all().item())


def bwd_split(q, kv, sink, idx, o, lse, do, scale, cfg: dict | None = None, parts: dict | None = None):
    """dq, dkv, dsink with the split kernels; idx padded here to a multiple of 128 (as the forward
    pads it). ``parts`` (a dict), if given, receives the intermediates (bench)."""
    from .sparse_attn_tl import _pad_idx, delta_kernel
    k = dict(DEFAULT_CFG, **(cfg or {}))
    B, M, H, D = q.shape
    idx = _pad_idx(idx, 128)                                      # no-op for the forward's padded idx
    TP = idx.shape[-1]
    if TP % k["BI"] or TP % k["dkv_BI"]:
        raise ValueError(f"bwd_split: BI {k['BI']} and dkv_BI {k['dkv_BI']} must divide 128")
    q, kv, do = q.contiguous(), kv.contiguous(), do.contiguous()
    W = k["window"]
    o = o.contiguous()
    if W and k["fuse_delta"]:
        delta = torch.empty(B, M, H, dtype=torch.float32, device=q.device)   # written by the dq kernel
    else:
        delta = delta_kernel(H, D)(o.reshape(B * M, H, D), do.reshape(B * M, H, D)).view(B, M, H)
    if W and k["win_check"] and not check_window(idx, W, k["win_base"]):
        raise ValueError(f"bwd_split: window={W} given but idx[..., :{W}] is not a sliding window "
                         f"(base {k['win_base']})")
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if W:
        BQ = k["win_BQ"]
        MP = -(-M // BQ) * BQ
        pw = torch.empty(B, MP, H, W + BQ, dtype=q.dtype, device=q.device)
        dsw = torch.empty_like(pw)
        pw[:, M:].zero_()
        dsw[:, M:].zero_()
        dq, p, ds = dq_kernel(H, D, TP, float(scale), BI=k["BI"], stages=k["dq_stages"], threads=k["dq_threads"],
                              window=W, BQ=BQ, fuse_delta=k["fuse_delta"])(q, kv, do, o, idx, lse, delta, pw, dsw)
        dkv_window_kernel(H, D, W=W, BQ=BQ, base=k["win_base"], DC=min(k["win_DC"], D), stages=k["win_stages"],
                          threads=k["win_threads"])(q, do, pw, dsw, dkv)
    else:
        dq, p, ds = dq_kernel(H, D, TP, float(scale), BI=k["BI"], stages=k["dq_stages"],
                              threads=k["dq_threads"])(q, kv, do, idx, lse, delta)
    if W < TP:
        dkv_kernel(H, D, TP, BI=k["dkv_BI"], DC=min(k["DC"], D), stages=k["dkv_stages"], threads=k["dkv_threads"],
                   ws=k["dkv_ws"], pad=k["dkv_pad"], t0=W)(q, do, idx, p, ds, dkv)
    p_sink = torch.exp2(sink.float() * LOG2E - lse)              # [B, M, H]
    dsink = -(p_sink * delta).sum((0, 1))
    if parts is not None:
        parts.update(delta=delta, p=p, ds=ds)
        if W:
            parts.update(pw=pw, dsw=dsw)
    return dq, dkv.to(kv.dtype), dsink.to(sink.dtype)
