"""Block-scaled fp8 GEMM C = A @ B^T with the release's 32-wide e8m0 blocks (SPEC §10.3), TileLang/Hopper.

a e4m3 [..., K] + a_s [..., K/32]; b e4m3 [N, K] + b_s [ceil(N/32), K/32] (32x32 weight blocks; the kernel
reads them expanded per column). Hopper's fp8 tensor cores take no block scales, so every 32-deep slice of K
is one WGMMA (k=32) into a temporary accumulator, promoted into the fp32 result with the product of its two
power-of-two scales (the release kernel's order: sum each K block, scale, accumulate in fp32). The main loop
is ``_gemm.promote_loop``, shared with the fp4 GEMM (FullRow warpgroups, scale product precomputed per
(row, 32-column block): one FFMA per accumulator element per slice).

Two kernels over that math. ``fp8_gemm_pingpong_kernel`` (the default where K is a multiple of 128): a
producer warpgroup TMA-loads A, B and both scale tiles into a ring of mbarrier stages, and two consumer
warpgroups, each owning 64 rows of the 128-row tile, take strict turns on the tensor core (one issues its
slice's WGMMA after the other's completed), so one consumer's promotion overlaps the other's WGMMA.
``fp8_gemm_kernel`` is the same loop scheduled by TileLang's pipeliner (``_gemm.promote_loop``, shared with
the fp4 GEMM): both consumers restart every K tile on the same barrier and promote in lock step.

Measured (H200, runs 10-11): ping-pong at BN=192, 2 stages 569 / 584 / 522 TFLOP/s at 4096x{5120x5120,
2304x5120, 5120x2304} (3 stages 560 / 559-571 / 521-527); the pipelined loop at BN=192 549 / 541 / 508 (BN=128 477, async promotion + BK=256
518); the ping-pong at BN=128 408-478. Removed after run 10: the first loop (two scale loads + FMUL + FFMA
per element, 359-386), the ping-pong's hand-over-at-issue and async-promotion orders (never faster).
Limit now: promotion costs one FFMA per accumulator element per 32-deep slice, about the cycles of the slice's
WGMMA, and the strict alternation still leaves the tensor core idle while both consumers wait on the TMA ring
(~60% of the 900 target). Next step: three consumer warpgroups (or BN=256 with a register-light promotion) so
that two WGMMAs are always queued, and a persistent tile scheduler to overlap each tile's epilogue.
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from ._common import compile_kernel
from ._gemm import promote_loop

SMEM_MAX = 227 * 1024 - 1024          # dynamic shared memory per CTA (H100/H200), minus barriers

BF16, F32, FP8 = "bfloat16", "float32", "float8_e4m3fn"


@functools.lru_cache(maxsize=None)
def fp8_gemm_kernel(N: int, K: int, BM: int = 128, BN: int = 192, BK: int = 128, stages: int = 4,
                    threads: int = 256, async_promote: bool = False, swizzle: int = 8):
    """The compiled kernel for one (N, K) and configuration; BM = 64 rows per consumer warpgroup
    (``threads = 2 * BM``). Defaults = the measured best (run 10, H200: BN=192 sync promotion 549
    TFLOP/s at 4096x5120x5120; stages=3 equal there, 555 vs 541 at N=2304)."""
    M = T.dynamic("M")
    KB, SB = K // 32, BK // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0 and BM == 64 * (threads // 128)
    body = promote_loop(BM, BN, SB, async_promote)

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

    return compile_kernel(fp8_gemm, out_idx=[4])


@functools.lru_cache(maxsize=None)
def fp8_gemm_pingpong_kernel(N: int, K: int, BN: int = 192, BK: int = 128, stages: int = 2, swizzle: int = 8,
                             nreg: tuple = (240, 24)):
    """The warp-specialised ping-pong kernel (384 threads, BM = 128). Defaults = the measured best (run 11:
    2 stages 569 / 584 / 522 TFLOP/s, 3 stages 560 / 559 / 521, BN=128 467 / 418 / 438).

    * warpgroup 2, the producer (``nreg[1]`` registers), TMA-loads A [128, BK], B [BN, BK] and their fp32
      scales into ring stage k % stages (``full[s]``: 128 arrivals + the TMA bytes) once both consumers
      released it (``empty[s]``, 256 arrivals);
    * consumer w in {0, 1} (``nreg[0]`` registers) owns output rows [64 w, 64 w + 64) (its own accumulator,
      m64 x nBN WGMMAs) and runs every 32-deep slice g as WGMMA -> promote; consumer 1 issues slice g after
      consumer 0's slice g completed, consumer 0 issues slice g + 1 after consumer 1's slice g completed
      (``turn`` mbarriers), so each promotion overlaps the other consumer's WGMMA.
    Numerics: those of ``_gemm.promote_loop`` (fp8 32x32 weight blocks: one FFMA per element per slice).
    Deadlock freedom: each turn barrier's phase g completes on one peer arrival and is waited on once; a
    consumer completes phase g + 1 of its peer's barrier only after waiting on its own phase g, which the peer
    completes after having waited phase g, so no barrier runs a phase ahead of its waiter.
    TMA needs K and BK multiples of 128 (a [rows, BK/32] fp32 scale box of >= 16 bytes a row).
    """
    M = T.dynamic("M")
    BM, HALF, NC = 128, 64, BN // 32
    KB, SB, NK = K // 32, BK // 32, K // BK
    if K % BK or BK % 128 or BN % 32:
        raise ValueError(f"fp8_gemm ping-pong: K={K}, BK={BK} must be multiples of 128 and BN={BN} of 32")
    assert 2 * nreg[0] + nreg[1] <= 504, nreg
    smem = stages * (BM + BN) * (BK + SB * 4) + BM * BN * 2
    if smem > SMEM_MAX:
        raise ValueError(f"fp8_gemm ping-pong: shared memory {smem} B over {SMEM_MAX}")

    @T.macro
    def consumer(w, acc, tmp, sp, a_s, b_s, sa, sb, c_s, full, empty, turn, done, C, bx, by):
        T.clear(acc)
        for k in T.serial(NK):
            s = k % stages
            T.barrier_wait(full[s], (k // stages) % 2)
            for kk in T.unroll(SB):
                g = k * SB + kk
                if w == 0:                              # my turn: the peer's previous slice completed
                    if g > 0:
                        T.barrier_wait(turn[0], (g - 1) % 2)
                else:
                    T.barrier_wait(turn[1], g % 2)
                T.wgmma_gemm(a_s[s, w * HALF:(w + 1) * HALF, kk * 32:(kk + 1) * 32],
                             b_s[s, :, kk * 32:(kk + 1) * 32], tmp, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                T.barrier_arrive(turn[1 - w])           # hand the tensor core over, then promote
                for i, c in T.Parallel(HALF, NC):
                    sp[i, c] = sa[s, w * HALF + i, kk] * sb[s, c * 32, kk]
                for i, j in T.Parallel(HALF, BN):
                    acc[i, j] += tmp[i, j] * sp[i, j // 32]
            T.barrier_arrive(empty[s])
        # both consumers are past their last read of the stages before either writes its output tile
        # (the shared-memory planner may overlay the tiles on the stages)
        T.barrier_arrive(done)
        T.barrier_wait(done, 0)
        T.copy(acc, c_s)
        T.copy(c_s, C[by * BM + w * HALF, bx * BN])

    @T.prim_func
    def fp8_gemm_pingpong(
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
            c_s0 = T.alloc_shared([HALF, BN], BF16)
            c_s1 = T.alloc_shared([HALF, BN], BF16)
            acc0 = T.alloc_fragment([HALF, BN], F32)
            tmp0 = T.alloc_fragment([HALF, BN], F32)
            sp0 = T.alloc_fragment([HALF, NC], F32)
            acc1 = T.alloc_fragment([HALF, BN], F32)
            tmp1 = T.alloc_fragment([HALF, BN], F32)
            sp1 = T.alloc_fragment([HALF, NC], F32)
            full = T.alloc_barrier(arrive_count=[128] * stages)
            empty = T.alloc_barrier(arrive_count=[256] * stages)
            turn = T.alloc_barrier(arrive_count=[128, 128])
            done = T.alloc_barrier(arrive_count=256)
            T.use_swizzle(swizzle)

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                consumer(0, acc0, tmp0, sp0, a_s, b_s, sa, sb, c_s0, full, empty, turn, done, C, bx, by)
            elif tx < 256:
                T.set_max_nreg(nreg[0], 1)
                consumer(1, acc1, tmp1, sp1, a_s, b_s, sa, sb, c_s1, full, empty, turn, done, C, bx, by)
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

    return compile_kernel(fp8_gemm_pingpong, out_idx=[4])


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
    """Same contract as ``reference.fp8_gemm`` (block_size 32 only). ``kernel``: "pingpong" (default where K
    is a multiple of 128) or "loop" (``fp8_gemm_kernel``, any K multiple of 32); other cfg keys go to it."""
    if block_size != 32:
        raise NotImplementedError("fp8_gemm (tilelang): block_size 32 only")
    K = a.shape[-1]
    N = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, K).contiguous()
    sa = _scales(a_s).reshape(-1, K // 32)
    kernel = cfg.pop("kernel", "pingpong" if K % 128 == 0 else "loop")
    if kernel == "pingpong":
        kern = fp8_gemm_pingpong_kernel(N, K, **cfg)
    elif kernel == "loop":
        bk = cfg.pop("BK", _pick_bk(K))
        kern = fp8_gemm_kernel(N, K, BK=bk, **cfg)
    else:
        raise ValueError(f"fp8_gemm (tilelang): kernel must be 'pingpong' or 'loop', got {kernel!r}")
    c = kern(a2, sa, b.contiguous(), _col_scales(b_s, N))
    return c.reshape(*lead, N).to(out_dtype)
