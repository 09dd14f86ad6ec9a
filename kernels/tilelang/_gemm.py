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
import functools

import tilelang.language as T
import torch

from functional_dsv41 import quant

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


# ----------------------------------------------------------------------------- scale operands
@functools.lru_cache(maxsize=None)
def e8m0_expand_kernel(KB: int, rep: int, threads: int = 256, per_thread: int = 4, krep: int = 1):
    """O [NR, KB * krep] fp32 = 2^(S[r // rep, c // krep] - 127) from S [R, KB] e8m0 bytes, in one launch (the
    GEMMs' fp32 scale operands: ``rep`` = 1 for activation scales, 32 to expand 32x32 weight blocks per column;
    ``krep`` = 4 to spread one scale per 128 columns (``quant.align_fp8_groups``) over the four 32-wide slots the
    GEMM's stage tiles read, which ``quant.expand_group_scales`` would do in separate torch launches).
    Exactly ``quant.e8m0_to_float``: byte e in 1..254 is the fp32 whose exponent field is e; 0 is 2^-127
    (subnormal); 255 is inf (ldexp(1, 128)). It replaces ~6 torch launches per operand (view, cast, subtract,
    ones, ldexp; repeat_interleave and a copy for B: 34 us each at 4096x5120x5120 on the H200, run 21), a fixed
    cost that dominated small-M (decode) GEMMs."""
    R, NR = T.dynamic("R"), T.dynamic("NR")
    BLK = threads * per_thread
    KO = KB * krep

    def src_col(c):                 # (a Python-level choice: krep = 1 builds the same TIR as before krep existed)
        return c if krep == 1 else c // krep

    @T.prim_func
    def e8m0_expand(S: T.Tensor([R, KB], "uint8"), O: T.Tensor([NR, KO], F32)):
        with T.Kernel(T.ceildiv(NR * KO, BLK), threads=threads) as bx:
            for i in T.Parallel(BLK):
                f = bx * BLK + i
                if f < NR * KO:
                    e = T.Cast("int32", S[f // KO // rep, src_col(f % KO)])
                    O[f // KO, f % KO] = T.if_then_else(e == 0, T.float32(2.0 ** -127),
                                                        T.reinterpret(e << 23, F32))

    from ._common import compile_kernel
    return compile_kernel(e8m0_expand)


def scales_f32(s: torch.Tensor, rep: int = 1, rows: int | None = None, krep: int = 1) -> torch.Tensor:
    """fp32 [rows, KB * krep] GEMM scale operand from e8m0 (or fp32) scales [..., KB]: each row of ``s`` repeated
    ``rep`` times, the first ``rows`` (default all) kept, each column repeated ``krep`` times (group scales to
    the 32-wide slots). e8m0 goes through ``e8m0_expand_kernel``."""
    KB = s.shape[-1]
    s2 = s.reshape(-1, KB)
    rows = s2.shape[0] * rep if rows is None else rows
    if s.dtype != quant.E8M0:
        out = quant.expand_group_scales(s2, 32 * krep).float() if krep > 1 else s2.float()
        return (out.repeat_interleave(rep, 0)[:rows] if rep > 1 else out[:rows]).contiguous()
    out = torch.empty(rows, KB * krep, dtype=torch.float32, device=s.device)
    if rows:
        e8m0_expand_kernel(KB, rep, krep=krep)(s2.contiguous().view(torch.uint8), out)
    return out


# ----------------------------------------------------------------------------- dequantisation to bf16
@functools.lru_cache(maxsize=None)
def dequant_bf16_kernel(K: int, fmt: str, row_rep: int = 1, kblock: int = 32, BR: int = 32, BC: int = 256,
                        threads: int | None = None):
    """O [R, K] bf16 = value(X[r, k]) * S[r // row_rep, k // kblock], one pass (the ``bf16`` GEMM path).

    ``fmt`` "e4m3": X [R, K] float8_e4m3fn; "e2m1": X [R, K/2] packed bytes (element 2j in the low nibble).
    S fp32 [ceil(R / row_rep), K / kblock] (``scales_f32``): 1 for per-row scales, 32 for 32x32 weight blocks.
    Exact: every e4m3 and e2m1 value times a power of two is a bf16 (8 exponent bits, 3 >= 1 mantissa bits)
    unless it leaves bf16's range, which fp32 scales from e8m0 cannot reach here (|value| <= 448 * 2^127 would;
    the quantisers' scales keep the products finite)."""
    R, RS = T.dynamic("R"), T.dynamic("RS")
    if K % BC or BC % kblock or fmt not in ("e4m3", "e2m1"):
        raise ValueError(f"dequant_bf16: K={K} must be a multiple of BC={BC} (a multiple of kblock={kblock}); "
                         f"fmt {fmt!r} must be 'e4m3' or 'e2m1'")
    KX, XT = (K, "float8_e4m3fn") if fmt == "e4m3" else (K // 2, "uint8")

    E, V = (1 if fmt == "e4m3" else 2), 8           # elements per input byte; elements per thread and step
    CPR = BC // V                                   # chunks of V elements per tile row
    threads = threads or min(256, BR * CPR)
    assert (BR * CPR) % threads == 0 and kblock % V == 0

    @T.prim_func
    def dequant_bf16(X: T.Tensor([R, KX], XT), S: T.Tensor([RS, K // kblock], F32),
                     O: T.Tensor([R, K], "bfloat16")):
        with T.Kernel(K // BC, T.ceildiv(R, BR), threads=threads) as (bx, by):
            # each thread converts chunks of V = 8 consecutive elements: one 8-byte (e4m3) / 4-byte (e2m1) load
            # and one 16-byte store per chunk, consecutive threads on consecutive chunks of a row (writing each
            # element from a T.Parallel loop stored 2 or 4 bytes at a time: 880 GB/s for e2m1 in run 26)
            tx = T.get_thread_binding()
            xb = T.alloc_local((V // E,), XT)
            ob = T.alloc_local((V,), "bfloat16")
            sc = T.alloc_local((1,), F32)
            for it in T.serial(BR * CPR // threads):
                c = it * threads + tx
                r = by * BR + c // CPR
                k0 = bx * BC + (c % CPR) * V
                if r < R:
                    for v in T.vectorized(V // E):
                        xb[v] = X[r, k0 // E + v]
                    sc[0] = S[r // row_rep, k0 // kblock]
                    for v in T.unroll(V):
                        if fmt == "e4m3":
                            ob[v] = T.Cast("bfloat16", T.Cast(F32, xb[v]) * sc[0])
                        else:                       # element 2p in the low nibble of byte p, 2p + 1 in the high
                            code = (T.Cast("int32", xb[v // 2]) >> (4 * (v % 2))) & 15
                            e = (code >> 1) & 3
                            m = code & 1
                            mag = T.if_then_else(e == 0, T.Cast(F32, m) * 0.5, T.Cast(F32, (m + 2) << e) * 0.25)
                            ob[v] = T.Cast("bfloat16", T.if_then_else(code >= 8, -mag, mag) * sc[0])
                    for v in T.vectorized(V):
                        O[r, k0 + v] = ob[v]

    from ._common import compile_kernel
    return compile_kernel(dequant_bf16, out_idx=[2])


def dequant_bf16(x: torch.Tensor, s: torch.Tensor, fmt: str, row_rep: int = 1, kblock: int = 32) -> torch.Tensor:
    """bf16 [rows, K] from quantised rows x ([rows, K] e4m3 or [rows, K/2] packed e2m1) and their e8m0/fp32
    scales s [ceil(rows / row_rep), K / kblock] (``dequant_bf16_kernel``)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    K = x2.shape[-1] * (2 if fmt == "e2m1" else 1)
    sf = scales_f32(s)
    if fmt == "e2m1":
        x2 = x2.view(torch.uint8)
    bc = next((c for c in (256, 128, 64, 32) if K % c == 0 and c % kblock == 0), None)
    if bc is None:
        raise ValueError(f"dequant_bf16: K={K} is not a multiple of the scale block {kblock} (and of 32)")
    return dequant_bf16_kernel(K, fmt, row_rep, kblock, BC=bc)(x2, sf)
