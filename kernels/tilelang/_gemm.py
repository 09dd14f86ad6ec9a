"""The block-scaled main loop shared by the fp8 and fp4 GEMMs, TileLang/Hopper (the only one since run 10).

One K tile of the pipeline holds ``a_s`` [BM, BK] and ``b_s`` [BN, BK] e4m3 in shared memory plus the
fp32 scales of its SB = BK/32 K blocks: ``sa`` [BM, SB] per row of A, ``sb`` [BN, SB] per column of B
(expanded per column: a [BN/32, SB] tile is under TMA's 128-byte minimum). Hopper's fp8 WGMMA takes no
block scales, so each 32-deep slice kk is one k=32 WGMMA into a temporary and is then promoted:

    acc[i, j] += tmp[i, j] * sp[i, j // 32],   sp[i, c] = sa[i, kk] * sb[32 c, kk]

(the release's order: sum each 32-deep block, scale, accumulate in fp32; the scales are powers of
two, so the product is exact and an FMA rounds exactly like the reference's multiply-then-add).

Why this form (vs. the first loop, removed after run 10 at 359-386 vs 549 TFLOP/s): it multiplied ``sa[i] * sb[j]`` per element (two
shared loads + FMUL + FFMA per accumulator element, 64 per thread per slice); here the scale product is
computed once per (row, 32-column block) into a small fragment (2 rows x BN/32 blocks per thread:
8 FMULs at BN=128), so promotion is one FFMA per element. The WGMMA uses the FullRow warp policy:
each consumer warpgroup owns 64 whole rows (m64 x nBN, one wide WGMMA instead of two n64 ones), so the
two warpgroups work on different output rows and naturally fall out of phase: the tensor core is
shared, so one warpgroup's WGMMA runs while the other promotes when they happen to drift apart (the
explicitly ordered version, ``fp8_gemm_tl.fp8_gemm_pingpong_kernel``, is 2-5% faster for fp8: run 10). With ``async_promote`` the WGMMA of
slice kk+1 is issued before slice kk is promoted (two temporaries, ``wait_wgmma(1)``).
"""
import tilelang.language as T

F32 = "float32"
FULL_ROW = T.GemmWarpPolicy.FullRow


def promote_loop(BM: int, BN: int, SB: int, async_promote: bool, per_col: bool = False):
    """A macro ``body(a_s, b_s, sa, sb, acc, tmp0, tmp1, sp)`` for one K tile (all SB slices).

    tmp0/tmp1: [BM, BN] fp32 fragments (tmp1 unused unless async_promote); sp: [BM, BN // 32] fp32 fragment
    (unused with per_col).

    ``per_col=False`` (fp8 weights: one scale per 32x32 block, so ``sb`` is constant over 32 output
    columns): the scale product is precomputed per (row, 32-column block), one FFMA per element.
    ``per_col=True`` (fp4 weights: one e8m0 scale per output column and 32-deep K block, [N, K/32]):
    ``acc[i, j] += (tmp[i, j] * sb[j, kk]) * sa[i, kk]``, an FMUL and an FFMA per element (both scales
    are powers of two, so the product is exact and the FFMA rounds like the reference's
    multiply-then-add). A thread holds 2 rows x BN/4 columns of the m64 fragment: 2 ``sa`` and BN/4
    ``sb`` shared loads per slice (the loads are shared between the two rows)."""
    NC = BN // 32

    if per_col:
        @T.macro
        def promote(tmp, sa, sb, acc, sp, kk):
            for i, j in T.Parallel(BM, BN):
                acc[i, j] += (tmp[i, j] * sb[j, kk]) * sa[i, kk]
    else:
        @T.macro
        def promote(tmp, sa, sb, acc, sp, kk):
            for i, c in T.Parallel(BM, NC):
                sp[i, c] = sa[i, kk] * sb[c * 32, kk]
            for i, j in T.Parallel(BM, BN):
                acc[i, j] += tmp[i, j] * sp[i, j // 32]

    if not async_promote:
        @T.macro
        def body(a_s, b_s, sa, sb, acc, tmp0, tmp1, sp):
            for kk in T.unroll(SB):
                T.gemm(a_s[:, kk * 32:(kk + 1) * 32], b_s[:, kk * 32:(kk + 1) * 32], tmp0,
                       transpose_B=True, clear_accum=True, policy=FULL_ROW)
                promote(tmp0, sa, sb, acc, sp, kk)
        return body

    @T.macro
    def body_async(a_s, b_s, sa, sb, acc, tmp0, tmp1, sp):
        for kk in T.unroll(SB):
            if kk % 2 == 0:
                T.wgmma_gemm(a_s[:, kk * 32:(kk + 1) * 32], b_s[:, kk * 32:(kk + 1) * 32], tmp0,
                             transpose_B=True, clear_accum=True, policy=FULL_ROW)
            else:
                T.wgmma_gemm(a_s[:, kk * 32:(kk + 1) * 32], b_s[:, kk * 32:(kk + 1) * 32], tmp1,
                             transpose_B=True, clear_accum=True, policy=FULL_ROW)
            if kk > 0:
                T.wait_wgmma(1)             # slice kk-1 is done; slice kk may still run
                if kk % 2 == 1:
                    promote(tmp0, sa, sb, acc, sp, kk - 1)
                else:
                    promote(tmp1, sa, sb, acc, sp, kk - 1)
        T.wait_wgmma(0)
        if (SB - 1) % 2 == 0:
            promote(tmp0, sa, sb, acc, sp, SB - 1)
        else:
            promote(tmp1, sa, sb, acc, sp, SB - 1)
    return body_async
