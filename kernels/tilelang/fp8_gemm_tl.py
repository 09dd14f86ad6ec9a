"""Block-scaled fp8 GEMM C = A @ B^T with the release's 32-wide e8m0 blocks (SPEC §10.3), TileLang/Hopper.

a e4m3 [..., K] + a_s [..., K/32]; b e4m3 [N, K] + b_s [ceil(N/32), K/32] (32x32 weight blocks; the kernel reads them expanded per column).
Hopper's fp8 tensor cores take no block scales, so every 32-deep slice of K is one WGMMA (k=32) into
a temporary accumulator, promoted into the fp32 result with the product of its two power-of-two
scales: ``acc += tmp * sa[m, kb] * sb[n // 32, kb]`` (the release kernel's order: sum each K block,
scale, accumulate in fp32). With ``async_promote`` the WGMMA of slice kk+1 is issued before slice
kk is promoted (two temporaries), so the tensor cores and the FMA pipe overlap inside a warpgroup.

``variant="v2"`` (the default since run 9, with BN=192 and synchronous promotion) is the shared main loop
of ``_gemm.py`` (FullRow warpgroups, scale product precomputed per (row, 32-column block): one FFMA per
element), also used by the fp4 GEMM; ``variant="v1"`` is the loop below (two scale loads + FMUL + FFMA per
element); ``variant="v3"`` is the warp-specialised ping-pong kernel (``_fp8_gemm_v3``).
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from ._common import compile_kernel
from ._gemm import promote_loop

BF16, F32, FP8 = "bfloat16", "float32", "float8_e4m3fn"


@functools.lru_cache(maxsize=None)
def fp8_gemm_kernel(N: int, K: int, BM: int = 128, BN: int = 192, BK: int = 128, stages: int = 4,
                    threads: int = 256, async_promote: bool = False, swizzle: int = 8, variant: str = "v2",
                    order: str = "done", nreg: tuple = (240, 24)):
    """The compiled kernel for one (N, K) and configuration. Defaults = the measured best (run 9, H200,
    4096x5120x5120: v2 BN=192 sync promotion 550 TFLOP/s vs v1 387, v2 BN=128 477); v1 is kept for
    the sweep (pass ``variant="v1", BN=128, async_promote=True`` for its old default). ``order``/``nreg``:
    the v3 kernel's own knobs (ignored by v1/v2); v3 fixes BM = 128 and 384 threads."""
    if variant == "v2":
        return _fp8_gemm_v2(N, K, BM, BN, BK, stages, threads, async_promote, swizzle)
    if variant == "v3":
        return _fp8_gemm_v3(N, K, BN, BK, stages, swizzle, order, tuple(nreg), async_promote)
    assert variant == "v1", variant
    M = T.dynamic("M")
    KB, SB = K // 32, BK // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0

    @T.prim_func
    def fp8_gemm(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bm: T.Tensor([N, K], FP8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            a_s = T.alloc_shared([BM, BK], FP8)
            b_s = T.alloc_shared([BN, BK], FP8)
            sa = T.alloc_shared([BM, SB], F32)
            sb = T.alloc_shared([BN, SB], F32)
            acc = T.alloc_fragment([BM, BN], F32)
            tmp0 = T.alloc_fragment([BM, BN], F32)
            tmp1 = T.alloc_fragment([BM, BN], F32)
            c_s = T.alloc_shared([BM, BN], BF16)
            T.use_swizzle(swizzle)
            T.clear(acc)
            for k in T.Pipelined(K // BK, num_stages=stages):
                T.copy(A[by * BM, k * BK], a_s)
                T.copy(Bm[bx * BN, k * BK], b_s)
                T.copy(As[by * BM, k * SB], sa)
                T.copy(Bs[bx * BN, k * SB], sb)
                if async_promote:
                    for kk in T.unroll(SB):
                        if kk % 2 == 0:
                            T.wgmma_gemm(a_s[:, kk * 32:(kk + 1) * 32], b_s[:, kk * 32:(kk + 1) * 32], tmp0,
                                         transpose_B=True, clear_accum=True)
                        else:
                            T.wgmma_gemm(a_s[:, kk * 32:(kk + 1) * 32], b_s[:, kk * 32:(kk + 1) * 32], tmp1,
                                         transpose_B=True, clear_accum=True)
                        if kk > 0:
                            T.wait_wgmma(1)
                            if kk % 2 == 1:
                                for i, j in T.Parallel(BM, BN):
                                    acc[i, j] += tmp0[i, j] * (sa[i, kk - 1] * sb[j, kk - 1])
                            else:
                                for i, j in T.Parallel(BM, BN):
                                    acc[i, j] += tmp1[i, j] * (sa[i, kk - 1] * sb[j, kk - 1])
                    T.wait_wgmma(0)
                    if (SB - 1) % 2 == 0:
                        for i, j in T.Parallel(BM, BN):
                            acc[i, j] += tmp0[i, j] * (sa[i, SB - 1] * sb[j, SB - 1])
                    else:
                        for i, j in T.Parallel(BM, BN):
                            acc[i, j] += tmp1[i, j] * (sa[i, SB - 1] * sb[j, SB - 1])
                else:
                    for kk in T.unroll(SB):
                        T.gemm(a_s[:, kk * 32:(kk + 1) * 32], b_s[:, kk * 32:(kk + 1) * 32], tmp0,
                               transpose_B=True, clear_accum=True)
                        for i, j in T.Parallel(BM, BN):
                            acc[i, j] += tmp0[i, j] * (sa[i, kk] * sb[j, kk])
            T.copy(acc, c_s)
            T.copy(c_s, C[by * BM, bx * BN])

    return compile_kernel(fp8_gemm, out_idx=[4])


def _fp8_gemm_v2(N, K, BM, BN, BK, stages, threads, async_promote, swizzle):
    """v2: the shared block-scaled main loop (``_gemm.promote_loop``); BM = 64 per consumer warpgroup."""
    M = T.dynamic("M")
    KB, SB = K // 32, BK // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0 and BM == 64 * (threads // 128)
    body = promote_loop(BM, BN, SB, async_promote)

    @T.prim_func
    def fp8_gemm_v2(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bm: T.Tensor([N, K], FP8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            a_s = T.alloc_shared([BM, BK], FP8)
            b_s = T.alloc_shared([BN, BK], FP8)
            sa = T.alloc_shared([BM, SB], F32)
            sb = T.alloc_shared([BN, SB], F32)
            acc = T.alloc_fragment([BM, BN], F32)
            tmp0 = T.alloc_fragment([BM, BN], F32)
            tmp1 = T.alloc_fragment([BM, BN], F32) if async_promote else tmp0
            sp = T.alloc_fragment([BM, BN // 32], F32)
            c_s = T.alloc_shared([BM, BN], BF16)
            T.use_swizzle(swizzle)
            T.clear(acc)
            for k in T.Pipelined(K // BK, num_stages=stages):
                T.copy(A[by * BM, k * BK], a_s)
                T.copy(Bm[bx * BN, k * BK], b_s)
                T.copy(As[by * BM, k * SB], sa)
                T.copy(Bs[bx * BN, k * SB], sb)
                body(a_s, b_s, sa, sb, acc, tmp0, tmp1, sp)
            T.copy(acc, c_s)
            T.copy(c_s, C[by * BM, bx * BN])

    return compile_kernel(fp8_gemm_v2, out_idx=[4])


def _fp8_gemm_v3(N, K, BN, BK, stages, swizzle, order: str = "done", nreg: tuple = (240, 24),
                 async_promote: bool = False):
    """v3: explicitly warp-specialised ping-pong (384 threads, BM = 128).

    Why: in v2 the two consumer warpgroups wait on the same "stage full" barrier every K tile, so they
    restart each tile in lock step: both issue their WGMMA together, both wait, both promote together,
    and the tensor core idles during the promotion (one FFMA per element per 32-deep slice costs about
    as many cycles on the FP32 pipe as the slice's WGMMA on the tensor core). Here the order is enforced:

    * warpgroup 2, the producer (``nreg[1]`` registers), TMA-loads A [128, BK], B [BN, BK] and their
      fp32 scales into ring stage k % stages (``full[s]``: 128 arrivals + the TMA bytes), after both
      consumers released it (``empty[s]``, 256 arrivals);
    * consumer warpgroup w in {0, 1} (``nreg[0]`` registers) owns output rows [64 w, 64 w + 64) of the
      tile (its own accumulator, m64 x nBN WGMMAs) and runs every 32-deep slice g as
      WGMMA -> promote; the two take turns on the tensor core through the ``turn`` mbarriers: consumer
      1 issues slice g after consumer 0 handed over slice g, consumer 0 issues slice g + 1 after
      consumer 1 handed over slice g. ``order="done"`` hands over when the WGMMA has completed
      (strict alternation: one consumer's promotion overlaps the other's WGMMA); ``order="issue"``
      right after issuing it (the peer's WGMMA queues behind, so the tensor core never waits for a
      hand-over, at the price of both WGMMAs sharing it); ``order="none"``: no turns (v2's schedule,
      explicit pipeline, for comparison). ``async_promote`` (with order "issue" or "none"): each
      consumer issues slice kk + 1 into a second temporary before promoting slice kk (within a K tile),
      so it keeps a WGMMA queued while it promotes (BN=128: acc + 2 tmp = 192 fp32 registers).

    Numerics: those of v2 (``_gemm.promote_loop``, fp8 32x32 weight blocks: one FFMA per element).
    Deadlock freedom: each turn barrier's phase g completes on one peer arrival and is waited on once;
    a consumer can complete phase g + 1 of its peer's barrier only after waiting on its own barrier's
    phase g, which the peer completes after having waited phase g, so no barrier runs a phase ahead
    of its waiter. Registers: acc + tmp = BN/2 fp32 each per thread (192 at BN=192) + the scale products.
    Shared memory: stages * (128 + BN) * (BK + BK/8) bytes + 128 * BN * 2 (the bf16 output tile).
    """
    M = T.dynamic("M")
    BM = 128
    KB, SB, NK = K // 32, BK // 32, K // BK
    G = NK * SB                                  # 32-deep slices per tile
    if K % BK or BK % 128:
        # the scale tiles go through TMA: a [rows, BK/32] fp32 box needs >= 16 bytes a row and the
        # [M, K/32] scale tensors a 16-byte row stride, so BK and K must be multiples of 128
        raise ValueError(f"fp8_gemm v3: K={K}, BK={BK}: both must be multiples of 128 (TMA scale tiles)")
    assert BN % 32 == 0 and order in ("done", "issue", "none")
    if async_promote and order == "done":
        raise ValueError("fp8_gemm v3: async_promote needs order 'issue' or 'none'")
    assert 2 * nreg[0] + nreg[1] <= 504, nreg
    smem = stages * (BM + BN) * (BK + SB * 4) + BM * BN * 2
    if smem > 227 * 1024 - 1024:
        raise ValueError(f"fp8_gemm v3: shared memory {smem} B over 227 KB")
    HALF = BM // 2
    NC = BN // 32

    @T.macro
    def promote(w, acc, tmp, sp, sa, sb, s, kk):
        for i, c in T.Parallel(HALF, NC):
            sp[i, c] = sa[s, w * HALF + i, kk] * sb[s, c * 32, kk]
        for i, j in T.Parallel(HALF, BN):
            acc[i, j] += tmp[i, j] * sp[i, j // 32]

    @T.macro
    def issue(w, tmp, a_s, b_s, turn, s, k, kk):
        """Wait for my turn (slice g = k SB + kk), issue the slice's WGMMA into tmp (asynchronous)."""
        g = k * SB + kk
        if order != "none":
            if w == 0:
                if g > 0:
                    T.barrier_wait(turn[0], (g - 1) % 2)
            else:
                T.barrier_wait(turn[1], g % 2)
        T.wgmma_gemm(a_s[s, w * HALF:(w + 1) * HALF, kk * 32:(kk + 1) * 32],
                     b_s[s, :, kk * 32:(kk + 1) * 32], tmp, transpose_B=True, clear_accum=True)
        if order == "issue":
            T.barrier_arrive(turn[1 - w])

    @T.macro
    def consumer(w, acc, tmp, tmpb, sp, a_s, b_s, sa, sb, c_s, full, empty, turn, done, C, bx, by):
        T.clear(acc)
        for k in T.serial(NK):
            s = k % stages
            T.barrier_wait(full[s], (k // stages) % 2)
            if async_promote:
                for kk in T.unroll(SB):
                    if kk % 2 == 0:
                        issue(w, tmp, a_s, b_s, turn, s, k, kk)
                    else:
                        issue(w, tmpb, a_s, b_s, turn, s, k, kk)
                    if kk > 0:
                        T.wait_wgmma(1)             # slice kk - 1 done, slice kk may still run
                        if kk % 2 == 1:
                            promote(w, acc, tmp, sp, sa, sb, s, kk - 1)
                        else:
                            promote(w, acc, tmpb, sp, sa, sb, s, kk - 1)
                T.wait_wgmma(0)
                if (SB - 1) % 2 == 0:
                    promote(w, acc, tmp, sp, sa, sb, s, SB - 1)
                else:
                    promote(w, acc, tmpb, sp, sa, sb, s, SB - 1)
            else:
                for kk in T.unroll(SB):
                    issue(w, tmp, a_s, b_s, turn, s, k, kk)
                    T.wait_wgmma(0)
                    if order == "done":
                        T.barrier_arrive(turn[1 - w])
                    promote(w, acc, tmp, sp, sa, sb, s, kk)
            T.barrier_arrive(empty[s])
        # both consumers are past their last read of the stages before either writes c_s
        # (the shared-memory planner may overlay c_s on them)
        T.barrier_arrive(done)
        T.barrier_wait(done, 0)
        T.copy(acc, c_s)
        T.copy(c_s, C[by * BM + w * HALF, bx * BN])

    @T.prim_func
    def fp8_gemm_v3(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bm: T.Tensor([N, K], FP8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=384) as (bx, by):
            a_s = T.alloc_shared([stages, BM, BK], FP8)
            b_s = T.alloc_shared([stages, BN, BK], FP8)
            sa = T.alloc_shared([stages, BM, SB], F32)
            sb = T.alloc_shared([stages, BN, SB], F32)
            c_s0 = T.alloc_shared([HALF, BN], BF16)      # each consumer's bf16 output tile
            c_s1 = T.alloc_shared([HALF, BN], BF16)
            acc0 = T.alloc_fragment([HALF, BN], F32)
            tmp0 = T.alloc_fragment([HALF, BN], F32)
            tmp0b = T.alloc_fragment([HALF, BN], F32) if async_promote else tmp0
            sp0 = T.alloc_fragment([HALF, NC], F32)
            acc1 = T.alloc_fragment([HALF, BN], F32)
            tmp1 = T.alloc_fragment([HALF, BN], F32)
            tmp1b = T.alloc_fragment([HALF, BN], F32) if async_promote else tmp1
            sp1 = T.alloc_fragment([HALF, NC], F32)
            full = T.alloc_barrier(arrive_count=[128] * stages)
            empty = T.alloc_barrier(arrive_count=[256] * stages)
            turn = T.alloc_barrier(arrive_count=[128, 128])
            done = T.alloc_barrier(arrive_count=256)
            T.use_swizzle(swizzle)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                consumer(0, acc0, tmp0, tmp0b, sp0, a_s, b_s, sa, sb, c_s0, full, empty, turn, done, C, bx, by)
            elif tx < 256:
                T.set_max_nreg(nreg[0], 1)
                consumer(1, acc1, tmp1, tmp1b, sp1, a_s, b_s, sa, sb, c_s1, full, empty, turn, done, C, bx, by)
            else:
                T.set_max_nreg(nreg[1], 0)
                for k in T.serial(NK):
                    s = k % stages
                    T.barrier_wait(empty[s], ((k // stages) % 2) ^ 1)
                    T.tma_copy(A[by * BM:(by + 1) * BM, k * BK:(k + 1) * BK], a_s[s, :, :], barrier=full[s])
                    T.tma_copy(Bm[bx * BN:(bx + 1) * BN, k * BK:(k + 1) * BK], b_s[s, :, :], barrier=full[s])
                    T.tma_copy(As[by * BM:(by + 1) * BM, k * SB:(k + 1) * SB], sa[s, :, :], barrier=full[s])
                    T.tma_copy(Bs[bx * BN:(bx + 1) * BN, k * SB:(k + 1) * SB], sb[s, :, :], barrier=full[s])
                    T.barrier_arrive(full[s])

    return compile_kernel(fp8_gemm_v3, out_idx=[4])


def _scales(s: torch.Tensor) -> torch.Tensor:
    return (quant.e8m0_to_float(s) if s.dtype == quant.E8M0 else s.float()).contiguous()


def _col_scales(b_s: torch.Tensor, N: int) -> torch.Tensor:
    """[ceil(N/32), K/32] block scales -> fp32 [N, K/32] per output column (a TMA tile of it is
    >= 128 bytes per pipeline stage; the [BN/32, 4] block tile is 64 bytes, which TMA refuses)."""
    return _scales(b_s).repeat_interleave(32, 0)[:N].contiguous()


def _pick_bk(K: int) -> int:
    for bk in (128, 64, 32):
        if K % bk == 0:
            return bk
    raise ValueError(f"fp8_gemm (tilelang): K={K} is not a multiple of 32")


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype=quant.E8M0, block_size: int = 32, out_dtype=torch.bfloat16, **cfg) -> torch.Tensor:
    """Same contract as ``reference.fp8_gemm`` (block_size 32 only)."""
    if block_size != 32:
        raise NotImplementedError("fp8_gemm (tilelang): block_size 32 only")
    K = a.shape[-1]
    N = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, K).contiguous()
    sa = _scales(a_s).reshape(-1, K // 32)
    bk = cfg.pop("BK", _pick_bk(K))
    kern = fp8_gemm_kernel(N, K, BK=bk, **cfg)
    c = kern(a2, sa, b.contiguous(), _col_scales(b_s, N))
    return c.reshape(*lead, N).to(out_dtype)
