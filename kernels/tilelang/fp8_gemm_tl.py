"""Block-scaled fp8 GEMM C = A @ B^T with the release's 32-wide e8m0 blocks (SPEC §10.3), TileLang/Hopper.

a e4m3 [..., K] + a_s [..., K/32]; b e4m3 [N, K] + b_s [ceil(N/32), K/32] (32x32 weight blocks; the kernel
reads them expanded per column). Hopper's fp8 tensor cores take no block scales, so every 32-deep slice of K
is one WGMMA (k=32) into a temporary accumulator, promoted into the fp32 result with the product of its two
power-of-two scales (the release kernel's order: sum each K block, scale, accumulate in fp32). The main loop
is ``_gemm.promote_loop``, shared with the fp4 GEMM (FullRow warpgroups, scale product precomputed per
(row, 32-column block): one FFMA per accumulator element per slice).

Four kernels over that math. ``fp8_gemm_ws_tl.fp8_gemm_halves_kernel`` (``kernel="halves"``, the default where K
is a multiple of 128 and M fills the GPU): the producer/consumer ring of the ws kernel with two consumers of 64
rows each, every slice's WGMMA split into two column halves and software-pipelined so that a consumer always has
one WGMMA of its own in flight while it promotes the other half, and the scale products of a whole stage loaded
at once. ``fp8_gemm_pingpong_kernel``: a producer warpgroup TMA-loads A, B and both scale tiles into a ring of
mbarrier stages, and two consumer warpgroups, each owning 64 rows of the 128-row tile, take strict turns on the
tensor core (one issues its slice's WGMMA after the other's completed, or with ``handoff="issue"`` after the other
issued), so one consumer's promotion overlaps the other's WGMMA. ``fp8_gemm_kernel`` is the same loop scheduled by
TileLang's pipeliner (``_gemm.promote_loop``, shared with the fp4 GEMM): both consumers restart every K tile on the
same barrier and promote in lock step. ``fp8_gemm_ws_tl.fp8_gemm_ws_kernel`` (``kernel="ws"``): the ring without
turn barriers, with 2 or 3 consumers, a persistent grid and 2-CTA multicast clusters (in that file).

Measured (H200, TFLOP/s at 4096x{5120x5120, 2304x5120, 5120x2304}): the ping-pong at BN=192, 2 stages 570 /
579 / 517 (run 14); the pipelined loop 548 / 544 / 513; ws, 3 consumers 536 / 512 / 506. Run 26 found the
limit of all of them in the shared layout: TileLang lays a k = 32 WGMMA operand out as [rows, 32] panels with a
32-byte swizzle, four TMA boxes of 32-byte rows per stage tile; with the whole 128-byte row swizzled
(``swizzle128``, now the default where BK = 128) a PLAIN fp8 GEMM in the ws structure (``diag="no_wait"``)
went from 546 to 1027, and the promoted kernels gained 5-8%: the ping-pong with ``early_sp`` 604 / 627 / 567, ws
with two temporaries 643 / 571 / 571 (bitwise-equal outputs). Run 41: ws with its per-slice wait but no promotion
runs 1034, the plain GEMM 1042, so synchronisation and operand traffic cost nothing; the promotion is the gap.
Run 42 (Nsight Compute source counters, SM clock 1965 MHz under load by nvidia-smi: no throttling) located it
in the consumers' instruction streams: the ping-pong's consumers spent ~25% of their time waiting for the turn,
~20% in FMULs waiting on the scale loads (shared memory is busy feeding the WGMMAs) and ~32% in FFMAs issuing at
under half rate; the halves kernel removes the turn waits and (``stage_scales``) most of the scale-load waits:
676 TFLOP/s against the ping-pong's 615 in the same run. What is left is the FFMA block itself: 96 FFMAs per
slice per consumer thread, issued at 0.3-0.5 per cycle (ncu: "dispatch" and "misc" stalls beside "selected"),
so each scheduler issues 0.58 instructions per cycle. Per 128 x 192 x 32 slice a scheduler has 192 FFMAs to
issue (one per accumulator element of its two consumer warps) against 192 tensor-core cycles at the nominal fp8
rate, so the 32-wide blocks make FFMA issue as scarce as tensor time. Run 47 (``benchmarks/micro_ffma_wgmma.py``)
measured why the two do not overlap: an independent FFMA stream in one warpgroup beside a WGMMA stream in another
takes 96-99% of the sum of their times alone, so the GEMM's time is its WGMMA time PLUS M*N*K/1024 warp FFMAs
(112 us at 4096x5120x5120): ~675 TFLOP/s with our plain part's 1042, ~744 with cuBLAS's 1212; 900 would need the
plain part at ~1690 on real data. The 6.55-wave grid's part-filled 7th wave costs only 1.4-2.4% (run 135,
``bench --only gemmtail``: its CTAs run faster with the chip half idle), so stream-K would add ~2%; a faster
plain part (cuBLAS's 1212 against our 1042) is what is left below the ~744 bound. Past Hopper: the release's
blocks are the MX format (32 elements along K, e8m0 scales; a 32x32 weight block is 32 rows of such blocks), which
Blackwell's block-scaled MMA (tcgen05, kind::mxf8f6f4) applies inside the tensor core, with its accumulators in
tensor memory, so there the promotion and its FFMAs disappear. Small M (decode, short
prefill): ``default_config`` picks a 64-row loop whose grid fits one wave (run 27: 23-32 us against the
ping-pong's 52-58 up to M = 128).

Fewer promotions on Hopper: ``fp8_gemm(..., group=128)`` takes operands re-expressed at one power-of-two scale per
128 columns (``quant.align_fp8_groups``, ``act_quant_tl.act_quant_grouped`` for activations in one pass; exact
but for values far below their group's largest) and runs the halves kernel with ``group=128``: four k = 32
WGMMAs chained in the tensor core, then one FFMA per element, a quarter of the FFMAs run 47 found adding to the
WGMMA time. With ``one_tmp`` (one temporary for both halves) BN = 256 fits, 4.85 waves at 4096 x 5120. Runs
164-165 (H100, medians of 10 interleaved rounds): 1062 TFLOP/s at 4096x5120x5120 against the exact order's 653 in
the same rounds and ``_scaled_mm``'s 1210; 1012 and 1010 at the other two release shapes. Its numerics are not
SPEC §10.3's order: the tensor core sums a group's 128 products in its fixed-point accumulator (cosine diff 1.8e-7
against SPEC §10.3 on the release's own operands, against 1.2e-7 for the exact kernels).
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from .. import reference

from ._common import Unsupported, compile_kernel, register_pool_per_row, sm_count
from ._gemm import dequant_bf16, promote_loop, scales_f32

SMEM_MAX = 227 * 1024 - 1024          # dynamic shared memory per CTA (H100/H200), minus barriers

BF16, F32, FP8 = "bfloat16", "float32", "float8_e4m3fn"


@functools.lru_cache(maxsize=None)
def fp8_gemm_kernel(N: int, K: int, BM: int = 128, BN: int = 192, BK: int = 128, stages: int = 4,
                    threads: int = 256, async_promote: bool = False, swizzle: int = 8,
                    swizzle128: bool | None = None):
    """The compiled kernel for one (N, K) and configuration; BM = 64 rows per consumer warpgroup
    (``threads = 2 * BM``). Defaults = the measured best (run 10, H200: BN=192 sync promotion 549
    TFLOP/s at 4096x5120x5120; stages=3 equal there, 555 vs 541 at N=2304; run 26 with ``swizzle128``: 582 /
    591). ``swizzle128`` (default: where BK = 128): the A and B stage tiles in one 128-byte-swizzled layout
    (``_common._install_wide_swizzle``; bitwise-equal output)."""
    swizzle128 = BK == 128 if swizzle128 is None else swizzle128
    M = T.dynamic("M")
    KB, SB = K // 32, BK // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0 and BM == 64 * (threads // 128)
    body = promote_loop(BM, BN, SB, async_promote)

    @T.macro
    def tile_loop(a_s, b_s, A, As, Bm, Bs, C, bx, by):
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

    @T.prim_func
    def fp8_gemm(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bm: T.Tensor([N, K], FP8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            if swizzle128:  # one 128-byte-swizzled [rows, BK] tile per operand (_common._install_wide_swizzle)
                a_sw128 = T.alloc_shared([BM, BK], FP8)
                b_sw128 = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_sw128, b_sw128, A, As, Bm, Bs, C, bx, by)
            else:
                a_s = T.alloc_shared([BM, BK], FP8)
                b_s = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_s, b_s, A, As, Bm, Bs, C, bx, by)

    return compile_kernel(fp8_gemm, out_idx=[4])


def _stage_macros(W: int, BM: int, BN: int, BK: int, SB: int, stages: int, cluster: int = 1):
    """The warp-specialised kernels' shared steps, as macros.

    ``load(it, k, bx, by, ...)``: the producer's ring position ``it`` (stage it % stages): wait for the stage's
    release, TMA-load A [BM, BK], B [BN, BK] of K tile k and their fp32 scales (``cluster`` 2: A and its
    scales multicast by rank 0 into both CTAs of the pair), arrive on ``full``.
    ``promote(w, s, kk, tmp, acc, sp, sa, sb)``: consumer w (rows [W w, W w + W)) adds its 32-deep slice kk
    of stage s into acc with the product of the two power-of-two scales (one FFMA per element)."""
    NC = BN // 32

    @T.macro
    def scale_products(w, s, kk, sp, sa, sb):
        for i, c in T.Parallel(W, NC):
            sp[i, c] = sa[s, w * W + i, kk] * sb[s, c * 32, kk]

    @T.macro
    def accumulate(tmp, acc, sp):
        for i, j in T.Parallel(W, BN):
            acc[i, j] += tmp[i, j] * sp[i, j // 32]

    @T.macro
    def promote(w, s, kk, tmp, acc, sp, sa, sb):
        scale_products(w, s, kk, sp, sa, sb)
        accumulate(tmp, acc, sp)

    @T.macro
    def load(it, k, bx, by, a_s, b_s, sa, sb, full, empty, A, As, Bm, Bs):
        s = it % stages
        T.barrier_wait(empty[s], ((it // stages) % 2) ^ 1)
        if cluster == 1:
            T.tma_copy(A[by * BM:(by + 1) * BM, k * BK:(k + 1) * BK], a_s[s, :, :], barrier=full[s])
            T.tma_copy(Bm[bx * BN:(bx + 1) * BN, k * BK:(k + 1) * BK], b_s[s, :, :], barrier=full[s])
            T.tma_copy(As[by * BM:(by + 1) * BM, k * SB:(k + 1) * SB], sa[s, :, :], barrier=full[s])
            T.tma_copy(Bs[bx * BN:(bx + 1) * BN, k * SB:(k + 1) * SB], sb[s, :, :], barrier=full[s])
        else:                                           # A, sa: rank 0 multicasts to both; B, sb: own
            T.tma_copy(A[by * BM:(by + 1) * BM, k * BK:(k + 1) * BK], a_s[s, :, :], barrier=full[s],
                       cluster_mask=0b11)
            T.tma_copy(Bm[bx * BN:(bx + 1) * BN, k * BK:(k + 1) * BK], b_s[s, :, :], barrier=full[s])
            T.tma_copy(As[by * BM:(by + 1) * BM, k * SB:(k + 1) * SB], sa[s, :, :], barrier=full[s],
                       cluster_mask=0b11)
            T.tma_copy(Bs[bx * BN:(bx + 1) * BN, k * SB:(k + 1) * SB], sb[s, :, :], barrier=full[s])
        T.barrier_arrive(full[s])

    return promote, load, scale_products, accumulate


@functools.lru_cache(maxsize=None)
def fp8_gemm_pingpong_kernel(N: int, K: int, BN: int = 192, BK: int = 128, stages: int = 2, swizzle: int = 8,
                             nreg: tuple = (240, 24), swizzle128: bool | None = None,
                             early_sp: bool = True, handoff: str = "complete"):
    """The warp-specialised ping-pong kernel (384 threads, BM = 128). Defaults = the measured best (run 11:
    2 stages 569 / 584 / 522 TFLOP/s, 3 stages 560 / 559 / 521, BN=128 467 / 418 / 438; run 26, with the
    128-byte-swizzled stage tiles (``swizzle128``, default where BK = 128) and the scale products computed
    while the slice's WGMMA runs (``early_sp``): 604 / 627 / 567, against 569 / 583 / 519 without either).

    * warpgroup 2, the producer (``nreg[1]`` registers), TMA-loads A [128, BK], B [BN, BK] and their fp32
      scales into ring stage k % stages (``full[s]``: 128 arrivals + the TMA bytes) once both consumers
      released it (``empty[s]``, 256 arrivals);
    * consumer w in {0, 1} (``nreg[0]`` registers) owns output rows [64 w, 64 w + 64) (its own accumulator,
      m64 x nBN WGMMAs) and runs every 32-deep slice g as WGMMA -> promote; consumer 1 issues slice g after
      consumer 0's slice g completed, consumer 0 issues slice g + 1 after consumer 1's slice g completed
      (``turn`` mbarriers), so each promotion overlaps the other consumer's WGMMA. ``handoff="issue"``: the
      turn is handed over right after the slice's WGMMA is issued instead of after it completed, so the peer's
      WGMMA is queued on the tensor core behind it (no idle tensor core between the two) while the order of
      issue stays alternating.
    Numerics: those of ``_gemm.promote_loop`` (fp8 32x32 weight blocks: one FFMA per element per slice).
    Deadlock freedom: each turn barrier's phase g completes on one peer arrival and is waited on once; a
    consumer completes phase g + 1 of its peer's barrier only after waiting on its own phase g, which the peer
    completes after having waited phase g, so no barrier runs a phase ahead of its waiter.
    TMA needs K and BK multiples of 128 (a [rows, BK/32] fp32 scale box of >= 16 bytes a row).
    """
    swizzle128 = BK == 128 if swizzle128 is None else swizzle128
    M = T.dynamic("M")
    BM, HALF, NC = 128, 64, BN // 32
    KB, SB, NK = K // 32, BK // 32, K // BK
    if K % BK or BK % 128 or BN % 32:
        raise ValueError(f"fp8_gemm ping-pong: K={K}, BK={BK} must be multiples of 128 and BN={BN} of 32")
    if handoff not in ("complete", "issue"):
        raise ValueError(f"fp8_gemm ping-pong: handoff must be 'complete' or 'issue', got {handoff!r}")
    if 2 * nreg[0] + nreg[1] > register_pool_per_row(384):
        raise ValueError(f"fp8_gemm ping-pong: nreg={nreg} over the 384-thread CTA's register pool "
                         f"({register_pool_per_row(384)} per thread of a warpgroup row)")
    smem = stages * (BM + BN) * (BK + SB * 4) + BM * BN * 2
    if smem > SMEM_MAX:
        raise ValueError(f"fp8_gemm ping-pong: shared memory {smem} B over {SMEM_MAX}")

    promote, load, scale_products, accumulate = _stage_macros(HALF, BM, BN, BK, SB, stages)

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
                if handoff == "issue":                  # the peer's WGMMA queues behind this one
                    T.barrier_arrive(turn[1 - w])
                if early_sp:                            # the scale loads overlap the WGMMA
                    scale_products(w, s, kk, sp, sa, sb)
                T.wait_wgmma(0)
                if handoff == "complete":
                    T.barrier_arrive(turn[1 - w])       # hand the tensor core over, then promote
                if early_sp:
                    accumulate(tmp, acc, sp)
                else:
                    promote(w, s, kk, tmp, acc, sp, sa, sb)
            T.barrier_arrive(empty[s])
        # both consumers are past their last read of the stages before either writes its output tile
        # (the shared-memory planner may overlay the tiles on the stages)
        T.barrier_arrive(done)
        T.barrier_wait(done, 0)
        T.copy(acc, c_s)
        T.copy(c_s, C[by * BM + w * HALF, bx * BN])

    @T.macro
    def body(a_s, b_s, A, As, Bm, Bs, C, bx, by):
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
                load(k, k, bx, by, a_s, b_s, sa, sb, full, empty, A, As, Bm, Bs)

    @T.prim_func
    def fp8_gemm_pingpong(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bm: T.Tensor([N, K], FP8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=384) as (bx, by):
            if swizzle128:  # one 128-byte-swizzled [rows, BK] tile per operand (_common._install_wide_swizzle)
                a_sw128 = T.alloc_shared([stages, BM, BK], FP8)
                b_sw128 = T.alloc_shared([stages, BN, BK], FP8)
                body(a_sw128, b_sw128, A, As, Bm, Bs, C, bx, by)
            else:           # TileLang's own layout: four 32-byte-swizzled [rows, 32] panels per tile
                a_s = T.alloc_shared([stages, BM, BK], FP8)
                b_s = T.alloc_shared([stages, BN, BK], FP8)
                body(a_s, b_s, A, As, Bm, Bs, C, bx, by)

    return compile_kernel(fp8_gemm_pingpong, out_idx=[4])


def _scales(s: torch.Tensor, krep: int = 1) -> torch.Tensor:
    """e8m0 / fp32 scales [..., K/32] (or [..., K/(32 krep)], one per group of krep blocks) -> fp32 [rows, K/32]
    (one launch: ``_gemm.scales_f32``)."""
    return scales_f32(s, krep=krep)


def _col_scales(b_s: torch.Tensor, N: int, krep: int = 1) -> torch.Tensor:
    """[ceil(N/32), K/32] block scales (or [ceil(N/32), K/(32 krep)]) -> fp32 [N, K/32] per output column (a TMA
    tile of it is >= 128 bytes per pipeline stage; the [BN/32, 4] block tile is 64 bytes, which TMA refuses)."""
    return scales_f32(b_s, rep=32, rows=N, krep=krep)


def _pick_bk(K: int) -> int:
    for bk in (128, 64, 32):
        if K % bk == 0:
            return bk
    raise ValueError(f"fp8_gemm (tilelang): K={K} is not a multiple of 32")


# Small-M (decode / short prefill) tiles: the ping-pong's 128 x 192 tiles leave most of the 132 SMs idle below a
# few hundred rows (27 CTAs at M <= 128, N = 5120), and there the GEMM is bound by reading B. Run 27 (us, N =
# 5120 / 2304, K = 5120): M <= 64: ping-pong 54-58, 64 x 64 loop 23-26; M = 128: ping-pong 54 / 53, 64 x 128
# loop 32 / 31, 64 x 64 loop 44 / 24; M = 256: ping-pong 55 / 53, 64 x 128 loop 58 / 31; M = 512: ping-pong 55 /
# 54, 64 x 128 loop 85 / 58. The best in every case: the first of SMALL_CFGS whose grid fits one wave.
SMALL_CFGS = (dict(kernel="loop", BM=64, BN=64, threads=128, stages=4),
              dict(kernel="loop", BM=64, BN=128, threads=128, stages=4))


def default_config(M: int, N: int, K: int, sms: int = 132) -> dict:
    """The kernel ``fp8_gemm`` runs for an M x N x K product when the caller names none: the first small-tile
    loop of SMALL_CFGS whose ceil(M / 64) x ceil(N / BN) CTAs fit one wave of ``sms`` SMs, else the halves kernel
    (``fp8_gemm_ws_tl.fp8_gemm_halves_kernel``) where K is a multiple of 128 (its TMA boxes need it), else the
    pipelined loop."""
    for cfg in SMALL_CFGS:
        if -(-M // cfg["BM"]) * -(-N // cfg["BN"]) <= sms:
            return dict(cfg)
    return dict(kernel="halves" if K % 128 == 0 else "loop")


def group_config(M: int, N: int, sms: int = 132) -> dict:
    """The kernel ``fp8_gemm(..., group=128)`` runs when the caller names none: the halves kernel with one
    temporary, at the column tile (256 or 192) whose grid fills its last wave best. Run 164 (H100): BN=256 1017
    TFLOP/s at 4096x5120x5120 (4.85 waves) and 995 at 4096x5120x2304; at N = 2304 it leaves 2.18 waves (850), and
    BN=192 (2.91) runs 1000."""
    def fill(BN):
        waves = -(-M // 128) * -(-N // BN) / sms
        return waves / max(1, -(-waves // 1))
    return dict(kernel="halves", group=128, one_tmp=True, BN=max((256, 192), key=fill))


def kernel_factory(kernel: str):
    """The kernel factory behind ``fp8_gemm``'s ``kernel`` name ("pingpong", "ws", "halves", "loop"): what the bench
    and scripts/precompile_kernels.py call to build a kernel directly, with the wrapper's error for other names."""
    from . import fp8_gemm_ws_tl as fw      # it imports this module
    factories = {"pingpong": fp8_gemm_pingpong_kernel, "ws": fw.fp8_gemm_ws_kernel,
                 "halves": fw.fp8_gemm_halves_kernel, "loop": fp8_gemm_kernel}
    if kernel not in factories:
        raise ValueError(f"fp8_gemm (tilelang): kernel must be 'pingpong', 'ws', 'halves' or 'loop', got "
                         f"{kernel!r}")
    return factories[kernel]


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype=quant.E8M0, block_size: int = 32, out_dtype=torch.bfloat16, group: int | None = None,
             **cfg) -> torch.Tensor:
    """Same contract as ``reference.fp8_gemm`` (block_size 32 only). With no cfg at all ``default_config`` picks
    the kernel by M and K; options without ``kernel`` go to the ping-pong (the loop where K % 128). ``kernel``: "pingpong" (``fp8_gemm_pingpong_kernel``, K a multiple of 128), "ws"
    (``fp8_gemm_ws_kernel``, K a multiple of 128; ``persistent=True`` = one CTA per SM; ``cluster=2`` = 2-CTA
    clusters multicasting the A tile, ceil(N/BN) even), "halves" (``fp8_gemm_halves_kernel``: each slice's WGMMA in
    two software-pipelined column halves), "loop" (``fp8_gemm_kernel``, any K multiple of 32) or
    "bf16" (both operands dequantised exactly to bf16, then torch's matmul); other cfg keys go to the kernel.
    ``group=128``: operands with one scale per 128 columns (``quant.align_fp8_groups``; a_s [..., K/128], b_s
    [ceil(N/32), K/128]) and the halves kernel's one promotion per group (``group_config`` picks its tile; a cfg
    must name kernel="halves"): a quarter of the FFMAs, not SPEC §10.3's summation order. Where M is small
    enough for ``default_config``'s one-wave 64-row loop (decode), that loop runs instead, on the scales expanded
    to 32-wide blocks."""
    reference.check_fp8_gemm(a, a_s, b, b_s, block_size, group)   # the torch op's shape checks, the same errors
    if block_size != 32:                # valid, but not what the kernels tile: impl="auto" runs the torch op
        raise Unsupported(f"fp8_gemm (tilelang): block_size 32 only, got {block_size}")
    K = a.shape[-1]
    N = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, K).contiguous()
    krep = 1                            # scale columns a scale spans in the kernels' 32-wide slots
    if group not in (None, 32):         # the kernel reads each group's scale from its first 32-wide slot
        if cfg and cfg.get("kernel") != "halves":
            raise ValueError(f"fp8_gemm (tilelang): group={group} runs kernel='halves' only, got cfg {cfg}")
        krep = group // 32              # (spread by the scale kernels themselves: two torch launches fewer each)
        small = default_config(a2.shape[0], N, K, sm_count(a.device))
        if not cfg and small["kernel"] == "loop":   # decode / short prefill: the one-wave 64-row loop, bound by
            cfg = small                             # reading B; on the expanded scales, SPEC §10.3's own order
        else:
            cfg = {**(cfg or group_config(a2.shape[0], N, sm_count(a.device))), "group": group}
    sa = _scales(a_s, krep).reshape(-1, K // 32)
    if not cfg:
        cfg = default_config(a2.shape[0], N, K, sm_count(a.device))
    kernel = cfg.pop("kernel", "pingpong" if K % 128 == 0 else "loop")
    if kernel == "bf16":                # exact bf16 operands (dequant_bf16), then torch's bf16 matmul (cuBLAS)
        ab = dequant_bf16(a2, a_s.reshape(-1, K // 32), "e4m3")
        c = torch.mm(ab, dequant_bf16(b, b_s, "e4m3", row_rep=32).t())
        return c.reshape(*lead, N).to(out_dtype)
    if cfg.get("diag"):
        raise ValueError("fp8_gemm (tilelang): diag kernels ignore the scales (bench only)")
    if "nreg" in cfg:                   # hashable for the factories' caches
        cfg["nreg"] = tuple(cfg["nreg"])
    if kernel == "ws" and cfg.get("persistent") is True:
        cfg["persistent"] = sm_count(a.device)
    if kernel == "loop":
        cfg["BK"] = cfg.get("BK", _pick_bk(K))
    kern = kernel_factory(kernel)(N, K, **cfg)
    c = kern(a2, sa, b.contiguous(), _col_scales(b_s, N, krep))
    return c.reshape(*lead, N).to(out_dtype)
