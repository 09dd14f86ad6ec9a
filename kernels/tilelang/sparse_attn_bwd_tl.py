"""Sparse attention backward (issue #7 item 1; the release ships none): the default split in two kernels (dq over
queries, dkv over (query, slot)), and the single-kernel "atomic" backward kept as its cross-check.

Shapes: q, o, do [B, M, H, D] bf16, kv [B, N, D] bf16 (K = V), idx [B, M, TP] int32 (-1 holes, TP a
multiple of BI), lse / delta [B, M, H] fp32 (lse in log2 units of the scaled logits, as the forward
writes it; delta = dO . O).

Math: Delta_h = dO_h . O_h (``delta_kernel``); recompute P from q, kv and LSE; dP = dO kv^T;
dS = scale * P * (dP - Delta); dq = dS kv; dkv[idx_t] += dS^T q + P^T dO (fp32 atomics into a [B, N, D]
fp32 buffer); dsink_h = -sum P_sink * Delta with P_sink = exp2(sink log2e - LSE). Rounding of P to bf16
in the forward is treated as the identity (straight-through), as FlashAttention does; P and dS enter the
backward GEMMs as bf16. ``bwd_kernel`` (atomic) does all of it in one kernel per (query, head block).

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

Measured at the release shape (H200, run 10): split 3.66 ms end to end = 234.5 TFLOP/s (the default,
``sparse_attn_tl.BWD_IMPL``) — dq kernel 1.80 ms, dkv kernel 1.70 ms — against 6.09 ms for the single
"atomic" kernel. What limits it: the dkv kernel's 302 M red.global.add.v4.f32 atomics, most on the
compressed slots (each query's top-k rows, scattered, so no two queries' adds can be merged). Next step:
cut those atomics (a reduction of the compressed slots' contributions that does not go through one
fp32 atomic per (query, row, 4 columns)). A sliding-window fast path (window rows summed over 64
queries in registers) was removed after run 10: 3.88-5.55 ms against 3.66 ms, and the model's window
layout (valid slots first) did not pass its layout check.

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
from .sparse_attn_tl import _gather_masked, _head_block, _pad_idx

BF16, F32, I32 = "bfloat16", "float32", "int32"


@functools.lru_cache(maxsize=None)
def delta_kernel(H: int, D: int, threads: int = 128):
    """Delta[b, m, h] = sum_d dO * O (fp32)."""
    R = T.dynamic("R")
    BH = _head_block(H)
    DC = min(D, 128)

    @T.prim_func
    def sparse_attn_delta(
        O: T.Tensor([R, H, D], BF16),
        dO: T.Tensor([R, H, D], BF16),
        Delta: T.Tensor([R, H], F32),
    ):
        with T.Kernel(R, H // BH, threads=threads) as (r, hb):
            o = T.alloc_fragment([BH, DC], F32)
            do = T.alloc_fragment([BH, DC], F32)
            acc = T.alloc_fragment([BH, DC], F32)
            delta = T.alloc_fragment([BH], F32)
            T.clear(acc)
            for k in T.serial(D // DC):
                T.copy(O[r, hb * BH:(hb + 1) * BH, k * DC:(k + 1) * DC], o)
                T.copy(dO[r, hb * BH:(hb + 1) * BH, k * DC:(k + 1) * DC], do)
                for h, d in T.Parallel(BH, DC):
                    acc[h, d] += o[h, d] * do[h, d]
            T.reduce_sum(acc, delta, dim=1)
            T.copy(delta, Delta[r, hb * BH:(hb + 1) * BH])

    return compile_kernel(sparse_attn_delta, out_idx=[2])


@functools.lru_cache(maxsize=None)
def bwd_kernel(H: int, D: int, TP: int, scale: float, BI: int = 64, DS: int = 4, threads: int = 256):
    """dq = bwd(q, kv, do, idx, lse, delta, dkv_acc); dkv_acc (fp32 [B, N, D]) accumulates in place.

    The [BI, D] dkv block is built in DS column slices (registers: dq takes BH*D/threads fp32)."""
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    BH = _head_block(H)
    NI = TP // BI
    c = float(scale) * LOG2E
    DH = D // DS
    gather = _gather_masked(BH, BI, D)

    @T.prim_func
    def sparse_attn_bwd(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        dO: T.Tensor([B, M, H, D], BF16),
        Idx: T.Tensor([B, M, TP], I32),
        Lse: T.Tensor([B, M, H], F32),
        Delta: T.Tensor([B, M, H], F32),
        dKV: T.Tensor([B, N, D], F32),
        dQ: T.Tensor([B, M, H, D], BF16),
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
            acc_dkv = T.alloc_fragment([BI, DH], F32)
            lse = T.alloc_fragment([BH], F32)
            delta = T.alloc_fragment([BH], F32)

            h0 = hb * BH
            T.copy(Q[bi, mi, h0:h0 + BH, :], q_s)
            T.copy(dO[bi, mi, h0:h0 + BH, :], do_s)
            T.copy(Lse[bi, mi, h0:h0 + BH], lse)
            T.copy(Delta[bi, mi, h0:h0 + BH], delta)
            T.clear(acc_dq)

            for it in T.Pipelined(NI, num_stages=0):
                gather(KV, Idx, bi, mi, it, kv_s, valid, acc_p)
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                for h, t in T.Parallel(BH, BI):
                    acc_p[h, t] = T.exp2(acc_p[h, t] * c - lse[h])
                for h, t in T.Parallel(BH, BI):
                    acc_dp[h, t] = acc_p[h, t] * (acc_dp[h, t] - delta[h]) * scale
                T.copy(acc_p, p_s)
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                for s in T.unroll(DS):
                    T.gemm(ds_s, q_s[:, s * DH:(s + 1) * DH], acc_dkv, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    T.gemm(p_s, do_s[:, s * DH:(s + 1) * DH], acc_dkv, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullRow)
                    for t, d in T.Parallel(BI, DH):
                        T.atomic_add(dKV[bi, T.max(Idx[bi, mi, it * BI + t], 0), s * DH + d], acc_dkv[t, d])

            T.copy(acc_dq, q_s)
            T.copy(q_s, dQ[bi, mi, h0:h0 + BH, :])

    return compile_kernel(sparse_attn_bwd, out_idx=[7])


@functools.lru_cache(maxsize=None)
def dq_kernel(H: int, D: int, TP: int, scale: float, BI: int = 64, stages: int = 1, threads: int = 256):
    """dq, P, dS = dq_kernel(q, kv, do, idx, lse, delta); P, dS bf16 [B, M, H, TP] (0 at holes).

    threads 256: two warpgroups split every GEMM's N (dq [64, 512] fp32 = 128 registers a thread;
    ptxas: 240 registers at stages 0, 255 + 472 B of spills at stages 1); threads 512: four warpgroups,
    dq 64 registers a thread, narrower (n16) QK / dP WGMMAs."""
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    BH = _head_block(H)
    NI = TP // BI
    c = float(scale) * LOG2E
    gather = _gather_masked(BH, BI, D)

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
                gather(KV, Idx, bi, mi, it, kv_s, valid, acc_p)
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
def dkv_kernel(H: int, D: int, TP: int, BI: int = 64, DC: int = 128, stages: int = 2, threads: int = 128,
               ws: bool = False, pad: int = 8):
    """dkv_kernel(q, do, idx, P, dS, dkv_acc): dkv_acc (fp32 [B, N, D]) += dS^T q + P^T dO per used row.

    One CTA per (D chunk, query, batch); the chunk index runs fastest so the D/DC CTAs of one query
    (which read the same P / dS tiles) are resident together and share them through L2.
    ws=False (default) turns TileLang's automatic warp specialisation off: with it, a TMA producer
    warpgroup is added and launch_bounds(256) reserves 168+ registers a thread, one CTA per SM; without
    it, DC=128 / 128 threads needs ~100 registers and 96 KB of shared memory, two CTAs per SM, so one
    CTA's atomics drain while the other runs its GEMMs.
    pad: extra fp32 columns of the staging tile's rows. The accumulator fragment is stored as float2
    per thread, 8 rows per warp; with a 128-float (512 B) row stride those 8 rows fall on the same
    banks (8-way conflicts on 32 KB of stores per block); 8 floats of padding spread them."""
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if TP % BI:
        raise ValueError(f"dkv_kernel: TP {TP} must be a multiple of BI {BI}")
    NI = TP // BI
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
                T.copy(P[bi, mi, :, it * BI:(it + 1) * BI], p_s)
                T.copy(dS[bi, mi, :, it * BI:(it + 1) * BI], ds_s)
                T.gemm(ds_s, q_s, acc, transpose_A=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                T.gemm(p_s, do_s, acc, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(acc, stage[:, 0:DC])
                for t, j in T.Parallel(BI, DC // 4):
                    if Idx[bi, mi, it * BI + t] >= 0:
                        T.atomic_addx4(dKV[bi, Idx[bi, mi, it * BI + t], d0 + j * 4], stage[t, j * 4])

    cfg = {} if ws else {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    return compile_kernel(sparse_attn_bwd_dkv, pass_configs=cfg)


# ----------------------------------------------------------------------------- launch helpers
# BI: the dq kernel's index block; dkv_BI: the dkv kernel's (its GEMM M; it reads P / dS back from
# global memory, so the two need not match; both must divide 128, the padding of idx).
DEFAULT_CFG = dict(BI=64, dq_stages=1, dq_threads=256, dkv_BI=64, DC=128, dkv_stages=2, dkv_threads=128, dkv_ws=False,
                   dkv_pad=8)


def bwd_split(q, kv, sink, idx, o, lse, do, scale, cfg: dict | None = None, parts: dict | None = None):
    """dq, dkv, dsink with the split kernels; idx padded here to a multiple of 128 (as the forward
    pads it). ``parts`` (a dict), if given, receives the intermediates (bench)."""
    k = dict(DEFAULT_CFG, **(cfg or {}))
    B, M, H, D = q.shape
    idx = _pad_idx(idx, 128)                                      # no-op for the forward's padded idx
    TP = idx.shape[-1]
    if TP % k["BI"] or TP % k["dkv_BI"]:
        raise ValueError(f"bwd_split: BI {k['BI']} and dkv_BI {k['dkv_BI']} must divide 128")
    q, kv, do = q.contiguous(), kv.contiguous(), do.contiguous()
    delta = delta_kernel(H, D)(o.contiguous().reshape(B * M, H, D), do.reshape(B * M, H, D)).view(B, M, H)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dq, p, ds = dq_kernel(H, D, TP, float(scale), BI=k["BI"], stages=k["dq_stages"],
                          threads=k["dq_threads"])(q, kv, do, idx, lse, delta)
    dkv_kernel(H, D, TP, BI=k["dkv_BI"], DC=min(k["DC"], D), stages=k["dkv_stages"], threads=k["dkv_threads"],
               ws=k["dkv_ws"], pad=k["dkv_pad"])(q, do, idx, p, ds, dkv)
    p_sink = torch.exp2(sink.float() * LOG2E - lse)              # [B, M, H]
    dsink = -(p_sink * delta).sum((0, 1))
    if parts is not None:
        parts.update(delta=delta, p=p, ds=ds)
    return dq, dkv.to(kv.dtype), dsink.to(sink.dtype)
