"""The warp-specialised block-scaled fp8 GEMM (``fp8_gemm(..., kernel="ws")``), TileLang/Hopper: not the default.

Math, operands and the measured comparison with the other kernels: ``fp8_gemm_tl``. ``fp8_gemm_ws_kernel`` is
the producer/consumer ring of the ping-pong without the turn barriers, with 2 or 3 consumer warpgroups (BM = 64
per consumer), optionally two temporaries per consumer (``double_tmp``), C written from registers
(``store="direct"``), a persistent grid, and 2-CTA clusters along N (``cluster=2``: rank 0 TMA-multicasts the
shared A tile and its scales into both CTAs, halving the A traffic; each stage is released by both CTAs'
consumers). ``diag`` variants (bench only, scales ignored) time the structure without the promotion.
"""
import functools

import tilelang.language as T

from ._common import compile_kernel, register_pool_per_row
from .fp8_gemm_tl import BF16, F32, FP8, SMEM_MAX, _stage_macros


@functools.lru_cache(maxsize=None)
def fp8_gemm_ws_kernel(N: int, K: int, consumers: int = 3, BN: int = 128, BK: int = 128, stages: int = 3,
                       double_tmp: bool = False, swizzle: int = 8, nreg: tuple = (160, 24), store: str = "auto",
                       persistent: int = 0, group: int = 8, diag: str = "", cluster: int = 1,
                       swizzle128: bool | None = None):
    """The warp-specialised kernel without turn-taking (``128 * (consumers + 1)`` threads, BM = 64 * consumers).

    * the last warpgroup, the producer (``nreg[1]`` registers), TMA-loads A [BM, BK], B [BN, BK] and their fp32
      scales into ring stage i % stages (``full``: 128 arrivals + the TMA bytes) once every consumer released it
      (``empty``: 128 * consumers arrivals);
    * consumer w (``nreg[0]`` registers) owns output rows [64 w, 64 w + 64) and runs every 32-deep slice on its
      own, WGMMA m64nBNk32 -> wait -> promote (one FFMA per accumulator element), with no barrier between the
      consumers: while one promotes, the others' WGMMAs are queued on the tensor core, so with 3 consumers at
      BN=128 (64 tensor cycles and 64 FFMA issue cycles per SMSP per slice) both pipes can stay busy.
      Registers: acc BN/2 + tmp BN/2 per thread = 128 at BN=128, under 160 (3 * 160 + 24 <= 512 per thread of
      the 4 warpgroups' 64K registers).
    * ``double_tmp`` (2 consumers, nreg 240): two temporaries; slice g + 1's WGMMA is issued before slice g is
      promoted (``wait_wgmma(1)``: g complete, g + 1 may still run) within a stage; the stage's last slice is
      drained (``wait_wgmma(0)``) and promoted before the stage is released (its WGMMAs completed and its
      scales read). Not across stages: ptxas then serialises every WGMMA (C7514; checked with -Xptxas -v).
    * ``store``: "smem" stages each consumer's bf16 tile in shared memory and TMA-stores it (after a ``done``
      barrier: the planner may overlay the tiles on the ring); "direct" writes bf16 pairs from registers (rows
      >= M masked); "auto" = smem where it fits beside the ring, else direct.
    * ``persistent`` = number of CTAs (e.g. 132 on the H200): each CTA walks tiles bid, bid + persistent, ...
      in a grouped order (``group`` row blocks of BM share the B tiles), the ring's stage/phase counter
      continuing across tiles, so the producer loads tile i + 1 while the consumers store tile i (direct store:
      no staging tile can alias the ring while the producer runs ahead).
    Numerics: those of ``_gemm.promote_loop`` (fp8 32x32 weight blocks: one FFMA per element per slice).
    TMA needs K and BK multiples of 128 (a [rows, BK/32] fp32 scale box of >= 16 bytes a row).

    ``diag`` (bench only, WRONG results: the scales are ignored; ``fp8_gemm`` refuses it) isolates the cost of
    the per-slice structure: "no_promote" keeps the per-slice WGMMA -> wait but accumulates in the WGMMA (no
    temporary, no FFMA); "no_wait" issues a stage's slices back to back into the accumulator and waits once per
    stage (a plain fp8 GEMM in this kernel's structure: its ceiling).

    ``cluster=2``: CTAs (2c, by) and (2c + 1, by) form a 2-CTA cluster (no rasterization swizzle: it would split
    the pair). Why: at 192x128 tiles the kernel runs near the L2's bandwidth (run 16: 73% of L2 throughput, a plain
    fp8 GEMM in this structure stops at 546 TFLOP/s); both CTAs need the same A tile and its scales, so rank 0
    TMA-multicasts them into both CTAs' rings (half the A traffic), each CTA loading its own B and sb. Protocol
    per ring stage s (both CTAs symmetric):
      - producer: wait own ``empty[s]``; A + sa multicast (issued by rank 0 only; each CTA's ``full[s]`` expects
        the bytes landing in its own shared memory: A + sa + B + sb); B + sb unicast; 128 arrivals on ``full[s]``;
      - consumer warpgroup: wait own ``full[s]``, compute, 128 local arrivals on ``empty[s]``, then
        (``__syncwarp``) lane 0 of each of its 4 warps arrives on the PEER's ``empty[s]``: ``empty[s]`` counts
        128 * consumers + 4 * consumers arrivals, so it completes only when the consumers of BOTH CTAs released
        the stage, the condition for rank 0's multicast to overwrite it in both CTAs;
      - a cluster barrier after the barrier init (the peer's multicast / remote arrivals need initialised
        mbarriers) and at the very end (the peer's last remote arrivals land before this CTA exits).
    Needs ceil(N / BN) even and no ``persistent``.
    """
    swizzle128 = BK == 128 if swizzle128 is None else swizzle128     # as in fp8_gemm_pingpong_kernel
    M = T.dynamic("M")
    W, NC = 64, BN // 32
    if diag not in ("", "no_promote", "no_wait") or (diag and double_tmp):
        raise ValueError(f"fp8_gemm ws: diag={diag!r} must be '', 'no_promote' or 'no_wait' (without double_tmp)")
    plain_acc, wait_slice, wait_stage = bool(diag), diag == "no_promote", diag == "no_wait"
    BM = W * consumers
    KB, SB, NK = K // 32, BK // 32, K // BK
    threads = 128 * (consumers + 1)
    if K % BK or BK % 128 or BN % 32:
        raise ValueError(f"fp8_gemm ws: K={K}, BK={BK} must be multiples of 128 and BN={BN} of 32")
    if consumers not in (2, 3) or (double_tmp and SB % 2):
        raise ValueError(f"fp8_gemm ws: consumers={consumers} must be 2 or 3 (double_tmp needs BK/32 even)")
    if consumers * nreg[0] + nreg[1] > register_pool_per_row(threads) or nreg[0] % 8 or nreg[1] % 8:
        raise ValueError(f"fp8_gemm ws: nreg={nreg} over the register pool of {threads} threads "
                         f"({register_pool_per_row(threads)} per thread of a warpgroup row)")
    if cluster not in (1, 2) or (cluster == 2 and persistent):
        raise ValueError(f"fp8_gemm ws: cluster={cluster} must be 1 or 2 (cluster=2 without a persistent grid)")
    if cluster == 2 and -(-N // BN) % 2:
        raise ValueError(f"fp8_gemm ws: cluster=2 pairs column blocks and needs an even number of column blocks, "
                         f"got ceil(N/BN) = ceil({N}/{BN}) = {-(-N // BN)}")
    ring = stages * (BM + BN) * (BK + SB * 4)
    if store == "auto":
        store = "smem" if not persistent and ring + BM * BN * 2 <= SMEM_MAX else "direct"
    if ring + (BM * BN * 2 if store == "smem" else 0) > SMEM_MAX or (persistent and store == "smem"):
        raise ValueError(f"fp8_gemm ws: shared memory {ring} B (+ staging, store={store}) over {SMEM_MAX}")

    promote, load, _, _ = _stage_macros(W, BM, BN, BK, SB, stages, cluster)

    @T.macro
    def issue(w, s, kk, tmp, a_s, b_s):
        T.wgmma_gemm(a_s[s, w * W:(w + 1) * W, kk * 32:(kk + 1) * 32], b_s[s, :, kk * 32:(kk + 1) * 32], tmp,
                     transpose_B=True, clear_accum=True)

    if cluster == 1:
        @T.macro
        def release(bar, s):
            T.barrier_arrive(bar[s])
    else:
        @T.macro
        def release(bar, s):
            """Local arrival by every consumer thread, then one per warp (after __syncwarp: the warp's reads of
            the stage are ordered before it) on the peer CTA's copy of the barrier."""
            T.barrier_arrive(bar[s])
            T.sync_warp()
            if T.get_thread_binding() % 32 == 0:
                T.mbarrier_arrive(bar[s], 1 - T.block_rank_in_cluster())

    @T.macro
    def stage_single(w, t, k, acc, tmp0, sp, a_s, b_s, sa, sb, full, empty):
        it = t * NK + k                                 # ring position, continuing across tiles
        s = it % stages
        T.barrier_wait(full[s], (it // stages) % 2)
        for kk in T.unroll(SB):
            if plain_acc:
                T.wgmma_gemm(a_s[s, w * W:(w + 1) * W, kk * 32:(kk + 1) * 32], b_s[s, :, kk * 32:(kk + 1) * 32], acc,
                             transpose_B=True)
                if wait_slice:
                    T.wait_wgmma(0)
            else:
                issue(w, s, kk, tmp0, a_s, b_s)
                T.wait_wgmma(0)
                promote(w, s, kk, tmp0, acc, sp, sa, sb)
        if wait_stage:
            T.wait_wgmma(0)
        release(empty, s)

    @T.macro
    def stage_double(w, t, k, acc, tmp0, tmp1, sp, a_s, b_s, sa, sb, full, empty):
        """Slices 2h -> tmp0, 2h+1 -> tmp1, each promoted while the next one's WGMMA runs; drained at the end of
        the stage: a WGMMA in flight across the K loop's back edge makes ptxas serialise every WGMMA (warning
        C7514; it stays with the mbarrier wait removed, so it is the back edge, not the wait loop)."""
        it = t * NK + k
        s = it % stages
        T.barrier_wait(full[s], (it // stages) % 2)
        for h in T.unroll(SB // 2):
            issue(w, s, 2 * h, tmp0, a_s, b_s)
            if h > 0:
                T.wait_wgmma(1)                         # slice 2h-1 done (2h may run)
                promote(w, s, 2 * h - 1, tmp1, acc, sp, sa, sb)
            issue(w, s, 2 * h + 1, tmp1, a_s, b_s)
            T.wait_wgmma(1)                             # slice 2h done (2h+1 may run)
            promote(w, s, 2 * h, tmp0, acc, sp, sa, sb)
        T.wait_wgmma(0)
        promote(w, s, SB - 1, tmp1, acc, sp, sa, sb)
        release(empty, s)                               # its WGMMAs completed, its scales read

    @T.macro
    def mainloop(w, t, acc, tmp0, tmp1, sp, a_s, b_s, sa, sb, full, empty):
        T.clear(acc)
        for k in T.serial(NK):
            if double_tmp:
                stage_double(w, t, k, acc, tmp0, tmp1, sp, a_s, b_s, sa, sb, full, empty)
            else:
                stage_single(w, t, k, acc, tmp0, sp, a_s, b_s, sa, sb, full, empty)

    def tile_of(t, bid):
        """(bx, by) of a persistent CTA's t-th tile: grouped order, ``group`` row blocks of BM per band."""
        tm, tn = T.ceildiv(M, BM), T.ceildiv(N, BN)
        tile = bid + t * persistent
        band = tile // (group * tn)
        rows = T.min(tm - band * group, group)
        r = tile % (group * tn)
        return r // rows, band * group + r % rows

    @T.macro
    def consumer(w, a_s, b_s, sa, sb, full, empty, done, C, bx, by):
        acc = T.alloc_fragment([W, BN], F32)
        tmp0 = T.alloc_fragment([W, BN], F32)
        tmp1 = T.alloc_fragment([W, BN], F32) if double_tmp else tmp0
        sp = T.alloc_fragment([W, NC], F32)
        if persistent:
            for t in T.serial(T.ceildiv(T.ceildiv(M, BM) * T.ceildiv(N, BN) - bx, persistent)):
                tx_, ty_ = tile_of(t, bx)
                mainloop(w, t, acc, tmp0, tmp1, sp, a_s, b_s, sa, sb, full, empty)
                T.copy(acc, C[ty_ * BM + w * W, tx_ * BN])
        else:
            mainloop(w, 0, acc, tmp0, tmp1, sp, a_s, b_s, sa, sb, full, empty)
            if store == "smem":
                c_s = T.alloc_shared([W, BN], BF16)
                T.barrier_arrive(done)                  # every consumer past its last read of the ring
                T.barrier_wait(done, 0)
                T.copy(acc, c_s)
                T.copy(c_s, C[by * BM + w * W, bx * BN])
            else:
                T.copy(acc, C[by * BM + w * W, bx * BN])

    @T.macro
    def producer(a_s, b_s, sa, sb, full, empty, A, As, Bm, Bs, bx, by):
        if persistent:
            for t in T.serial(T.ceildiv(T.ceildiv(M, BM) * T.ceildiv(N, BN) - bx, persistent)):
                tx_, ty_ = tile_of(t, bx)
                for k in T.serial(NK):
                    load(t * NK + k, k, tx_, ty_, a_s, b_s, sa, sb, full, empty, A, As, Bm, Bs)
        else:
            for k in T.serial(NK):
                load(k, k, bx, by, a_s, b_s, sa, sb, full, empty, A, As, Bm, Bs)

    if consumers == 2:
        @T.macro
        def consumers_of(tx, a_s, b_s, sa, sb, full, empty, done, C, bx, by):
            if tx < 128:
                consumer(0, a_s, b_s, sa, sb, full, empty, done, C, bx, by)
            else:
                consumer(1, a_s, b_s, sa, sb, full, empty, done, C, bx, by)
    else:
        @T.macro
        def consumers_of(tx, a_s, b_s, sa, sb, full, empty, done, C, bx, by):
            if tx < 128:
                consumer(0, a_s, b_s, sa, sb, full, empty, done, C, bx, by)
            elif tx < 256:
                consumer(1, a_s, b_s, sa, sb, full, empty, done, C, bx, by)
            else:
                consumer(2, a_s, b_s, sa, sb, full, empty, done, C, bx, by)

    @T.macro
    def body_on(a_s, b_s, A, As, Bm, Bs, C, bx, by):
        sa = T.alloc_shared([stages, BM, SB], F32)
        sb = T.alloc_shared([stages, BN, SB], F32)
        if cluster == 1:
            full = T.alloc_barrier(arrive_count=[128] * stages)
            empty = T.alloc_barrier(arrive_count=[128 * consumers] * stages)
        else:                                           # + lane 0 of each of the peer's 4 * consumers warps
            full = T.alloc_barrier(arrive_count=[128] * stages)
            empty = T.alloc_cluster_barrier([128 * consumers + 4 * consumers] * stages)
        done = T.alloc_barrier(arrive_count=128 * consumers)
        tx = T.get_thread_binding()
        if tx >= 128 * consumers:
            T.set_max_nreg(nreg[1], 0)
            producer(a_s, b_s, sa, sb, full, empty, A, As, Bm, Bs, bx, by)
        else:
            T.set_max_nreg(nreg[0], 1)
            consumers_of(tx, a_s, b_s, sa, sb, full, empty, done, C, bx, by)
        if cluster == 2:
            T.cluster_sync()                            # the peer's last remote arrivals landed: safe to exit

    @T.macro
    def body(A, As, Bm, Bs, C, bx, by):
        if swizzle128:      # one 128-byte-swizzled [rows, BK] tile per operand (_common._install_wide_swizzle)
            a_sw128 = T.alloc_shared([stages, BM, BK], FP8)
            b_sw128 = T.alloc_shared([stages, BN, BK], FP8)
            body_on(a_sw128, b_sw128, A, As, Bm, Bs, C, bx, by)
        else:               # TileLang's own layout: four 32-byte-swizzled [rows, 32] panels per tile
            a_s = T.alloc_shared([stages, BM, BK], FP8)
            b_s = T.alloc_shared([stages, BN, BK], FP8)
            body_on(a_s, b_s, A, As, Bm, Bs, C, bx, by)

    if persistent:
        @T.prim_func
        def fp8_gemm_ws(A: T.Tensor([M, K], FP8), As: T.Tensor([M, KB], F32), Bm: T.Tensor([N, K], FP8),
                        Bs: T.Tensor([N, KB], F32), C: T.Tensor([M, N], BF16)):
            with T.Kernel(persistent, threads=threads) as bid:
                body(A, As, Bm, Bs, C, bid, 0)
    elif cluster == 1:
        @T.prim_func
        def fp8_gemm_ws(A: T.Tensor([M, K], FP8), As: T.Tensor([M, KB], F32), Bm: T.Tensor([N, K], FP8),
                        Bs: T.Tensor([N, KB], F32), C: T.Tensor([M, N], BF16)):
            with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
                T.use_swizzle(swizzle)
                body(A, As, Bm, Bs, C, bx, by)
    else:                                               # clusters (2c, by), (2c + 1, by): no swizzle
        @T.prim_func
        def fp8_gemm_ws(A: T.Tensor([M, K], FP8), As: T.Tensor([M, KB], F32), Bm: T.Tensor([N, K], FP8),
                        Bs: T.Tensor([N, KB], F32), C: T.Tensor([M, N], BF16)):
            with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads, cluster_dims=(2, 1, 1)) as (bx, by):
                body(A, As, Bm, Bs, C, bx, by)

    return compile_kernel(fp8_gemm_ws, out_idx=[4])


@functools.lru_cache(maxsize=None)
def fp8_gemm_halves_kernel(N: int, K: int, BN: int = 192, BK: int = 128, stages: int = 3, swizzle: int = 8,
                           nreg: tuple | None = None, stage_scales: bool = True, consumers: int = 2,
                           chain: int = 1, group: int = 32, one_tmp: bool = False):
    """Two consumers (BM = 128; ``consumers=3``: BM = 192, 160 registers each), each slice's WGMMA split into two
    column halves, software-pipelined
    (``fp8_gemm(..., kernel="halves")``): the registers of the ping-pong (acc BN/2 + tmp BN/2 per thread) but
    always one WGMMA of the consumer's own in flight while it promotes.

    Why: Nsight Compute (runs 16, 33) found the ping-pong latency-bound at 49% of its issue slots: a consumer's
    chain per 32-deep slice is WGMMA -> wait -> promote -> next WGMMA, so its tensor core work and its FFMAs
    never overlap; a second full temporary (``double_tmp``) does not fit beside a 192-wide accumulator. Halves do:
    consumer w keeps accumulators accA / accB (columns [0, BN/2) and [BN/2, BN)) and temporaries tmpA / tmpB,
    and within a ring stage runs

        issue A0, B0;  for kk: wait A(kk), promote A(kk), issue A(kk+1); wait B(kk), promote B(kk), issue B(kk+1)

    (``wait_wgmma(1)``: WGMMA groups complete in issue order), so promoting one half overlaps the other's WGMMA.
    The stage's last half is drained (``wait_wgmma(0)``) before the stage is released, as in ``double_tmp``
    (a WGMMA in flight across the K loop's back edge makes ptxas serialise every WGMMA). No turns between the
    consumers: the ws ring (``fp8_gemm_ws_kernel``), C staged in shared memory per consumer and TMA-stored.
    ``chain=2``: the K loop's body is two ring stages of straight-line code, and the first issues the second's
    first two WGMMAs before promoting its own last half (one drain per two stages, at the loop's back edge); a
    chain waits for both its stages at its start, while no WGMMA is in flight
    (ptxas serialises every WGMMA when one is in flight across the mbarrier wait's spin loop: C7514).
    ``stage_scales`` (default): the scale products of all BK/32 slices of a stage are computed once, right after
    the stage's first two WGMMAs are issued (two 128-bit shared loads per row of A, one per 32-column block of B:
    2 x BK/32 x BN/64 products per half and thread), instead of per slice just before its wait; run 42 found the
    per-slice FMULs waiting on those loads for 20-29% of a consumer's time (shared memory is busy feeding the
    WGMMAs), and stage_scales took the kernel from 595 to 676 TFLOP/s at 4096x5120x5120.
    Numerics: bitwise those of every other kernel here (each 32-deep slice summed by the tensor core, then one
    FFMA per element with the exact power-of-two scale product, slices in order).

    ``group=128``: one promotion per 128-deep slice instead of per 32 (four k = 32 WGMMAs chained in the tensor
    core's accumulator, then one FFMA per element), a quarter of the FFMAs that run 47 found adding to the
    WGMMAs' time. Only valid where the scales are equal within each 128-column group (the kernel reads the
    group's first slot): operands re-expressed by ``quant.align_fp8_groups``, whose one scale per group
    ``fp8_gemm(..., group=128)`` spreads into every slot (``_gemm.scales_f32(krep=4)``; it takes nothing else: a
    shape check). The sum of a group's 128 products is then the tensor core's, not four fp32 promotions: not SPEC
    §10.3's order, within DESIGN's fp8 tolerance (``test_gpu_gemm.py::test_fp8_gemm_group128``).
    ``one_tmp``: one temporary for both halves, each half's WGMMAs waited for and promoted before the other's
    are issued (no overlap within a consumer, only across the two): its registers leave room for BN = 256
    (acc 128 + tmp 64 a thread), 640 tiles = 4.85 waves of 132 SMs at 4096 x 5120, against BN = 192's 6.55.
    """
    M = T.dynamic("M")
    if consumers not in (2, 3):
        raise ValueError(f"fp8_gemm halves: consumers={consumers} must be 2 or 3")
    if chain not in (1, 2) or (K // BK) % chain or chain > stages:
        raise ValueError(f"fp8_gemm halves: chain={chain} must be 1 or 2, at most stages={stages} and divide the "
                         f"K/BK = {K // BK} stages")
    nreg = nreg or ((240, 24) if consumers == 2 else (160, 24))
    W, BM, threads = 64, 64 * consumers, 128 * (consumers + 1)
    HB = BN // 2
    KB, SB, NK = K // 32, BK // 32, K // BK
    if K % BK or BK % 128 or BN % 64:
        raise ValueError(f"fp8_gemm halves: K={K}, BK={BK} must be multiples of 128 and BN={BN} of 64")
    if group not in (32, 128):
        raise ValueError(f"fp8_gemm halves: group={group} must be 32 (SPEC §10.3's promotion per block) or 128")
    GK, SG = group // 32, BK // group                   # 32-wide slices per promotion, promotions per stage
    if one_tmp and chain != 1:
        raise ValueError(f"fp8_gemm halves: one_tmp takes chain=1, got chain={chain}")
    if consumers * nreg[0] + nreg[1] > register_pool_per_row(threads) or nreg[0] % 8 or nreg[1] % 8:
        raise ValueError(f"fp8_gemm halves: nreg={nreg} over the {threads}-thread CTA's register pool "
                         f"({register_pool_per_row(threads)} per thread of a warpgroup row)")
    ring = stages * (BM + BN) * (BK + SB * 4)
    if ring + BM * BN * 2 > SMEM_MAX:
        raise ValueError(f"fp8_gemm halves: shared memory {ring + BM * BN * 2} B over {SMEM_MAX}")
    _, load, _, _ = _stage_macros(W, BM, BN, BK, SB, stages)
    HC = HB // 32                                       # 32-column scale blocks per half

    @T.macro
    def issue(w, s, kk, h, tmp, a_s, b_s):             # promotion slice kk: group / 32 chained k = 32 WGMMAs
        T.wgmma_gemm(a_s[s, w * W:(w + 1) * W, kk * group:(kk + 1) * group],
                     b_s[s, h * HB:(h + 1) * HB, kk * group:(kk + 1) * group], tmp, transpose_B=True,
                     clear_accum=True)

    SPK = SG if stage_scales else 1                     # promotion slices whose scale products sp holds at once

    @T.macro
    def scale_products(w, s, kk, h, sp, sa, sb):        # a group's scales: its first 32-wide slot
        for i, c in T.Parallel(W, HC):
            sp[i, c] = sa[s, w * W + i, kk * GK] * sb[s, (h * HC + c) * 32, kk * GK]

    @T.macro
    def stage_products(w, s, h, sp, sa, sb):
        for i, c in T.Parallel(W, SG * HC):
            sp[i, c] = sa[s, w * W + i, (c // HC) * GK] * sb[s, (h * HC + c % HC) * 32, (c // HC) * GK]

    @T.macro
    def accumulate(tmp, acc, sp, kk):
        for i, j in T.Parallel(W, HB):
            acc[i, j] += tmp[i, j] * sp[i, (kk % SPK) * HC + j // 32]

    @T.macro
    def one_tmp_stage(w, k, a_s, b_s, sa, sb, full, empty, accA, accB, tmp, spA, spB):
        s = k % stages
        T.barrier_wait(full[s], (k // stages) % 2)
        for kk in T.unroll(SG):
            issue(w, s, kk, 0, tmp, a_s, b_s)
            if stage_scales:
                if kk == 0:                             # all SG slices' products, while A0 runs
                    stage_products(w, s, 0, spA, sa, sb)
                    stage_products(w, s, 1, spB, sa, sb)
            else:
                scale_products(w, s, kk, 0, spA, sa, sb)
                scale_products(w, s, kk, 1, spB, sa, sb)
            T.wait_wgmma(0)
            accumulate(tmp, accA, spA, kk)
            issue(w, s, kk, 1, tmp, a_s, b_s)
            T.wait_wgmma(0)
            accumulate(tmp, accB, spB, kk)
        T.barrier_arrive(empty[s])

    @T.macro
    def two_tmp_stage(w, k, chained_in, chain_out, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, tmpB, spA,
                      spB):
        s = k % stages
        if not chained_in:                              # the whole chain's stages, while no WGMMA is in flight
            T.barrier_wait(full[s], (k // stages) % 2)  # (a wait loop with one in flight: ptxas C7514)
            if chain_out:
                T.barrier_wait(full[(k + 1) % stages], ((k + 1) // stages) % 2)
            issue(w, s, 0, 0, tmpA, a_s, b_s)
            issue(w, s, 0, 1, tmpB, a_s, b_s)
        if stage_scales:                                # all SG slices' products, while A0 / B0 run
            stage_products(w, s, 0, spA, sa, sb)
            stage_products(w, s, 1, spB, sa, sb)
        for kk in T.unroll(SG):                         # scale loads before each wait: off the path
            if not stage_scales:
                scale_products(w, s, kk, 0, spA, sa, sb)
            T.wait_wgmma(1)                             # A(kk) complete, B(kk) may run
            accumulate(tmpA, accA, spA, kk)
            if kk + 1 < SG:
                issue(w, s, kk + 1, 0, tmpA, a_s, b_s)
            elif chain_out:                             # the next stage's A0 behind this stage's B(last)
                issue(w, (k + 1) % stages, 0, 0, tmpA, a_s, b_s)
            if not stage_scales:
                scale_products(w, s, kk, 1, spB, sa, sb)
            if kk + 1 < SG or chain_out:
                T.wait_wgmma(1)                         # B(kk) complete, the next A may run
            else:
                T.wait_wgmma(0)                         # the stage's last WGMMA
            accumulate(tmpB, accB, spB, kk)
            if kk + 1 < SG:
                issue(w, s, kk + 1, 1, tmpB, a_s, b_s)
            elif chain_out:
                issue(w, (k + 1) % stages, 0, 1, tmpB, a_s, b_s)
        T.barrier_arrive(empty[s])                      # its WGMMAs completed, its scales read

    @T.macro
    def stage(w, k, chained_in, chain_out, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, tmpB, spA, spB):
        """Ring stage k of consumer w. ``chained_in``: its first two WGMMAs were issued by the previous stage;
        ``chain_out``: the next stage's first two WGMMAs are issued here, in the shadow of this stage's last
        promotions (instead of draining with wait_wgmma(0))."""
        if one_tmp:
            one_tmp_stage(w, k, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, spA, spB)
        else:
            two_tmp_stage(w, k, chained_in, chain_out, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, tmpB,
                          spA, spB)

    @T.macro
    def consumer(w, a_s, b_s, sa, sb, full, empty, done, C, bx, by):
        accA = T.alloc_fragment([W, HB], F32)
        accB = T.alloc_fragment([W, HB], F32)
        tmpA = T.alloc_fragment([W, HB], F32)
        tmpB = tmpA if one_tmp else T.alloc_fragment([W, HB], F32)
        spA = T.alloc_fragment([W, SPK * HC], F32)
        spB = T.alloc_fragment([W, SPK * HC], F32)
        T.clear(accA)
        T.clear(accB)
        for kc in T.serial(NK // chain):
            if chain == 1:
                stage(w, kc, False, False, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, tmpB, spA, spB)
            else:                                       # two stages of straight-line code: no back edge between
                stage(w, 2 * kc, False, True, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, tmpB, spA, spB)
                stage(w, 2 * kc + 1, True, False, a_s, b_s, sa, sb, full, empty, accA, accB, tmpA, tmpB, spA, spB)
        c_s = T.alloc_shared([W, BN], BF16)
        T.barrier_arrive(done)                          # both consumers past their last read of the ring
        T.barrier_wait(done, 0)
        T.copy(accA, c_s[:, 0:HB])
        T.copy(accB, c_s[:, HB:BN])
        T.copy(c_s, C[by * BM + w * W, bx * BN])

    @T.prim_func
    def fp8_gemm_halves(A: T.Tensor([M, K], FP8), As: T.Tensor([M, KB], F32), Bm: T.Tensor([N, K], FP8),
                        Bs: T.Tensor([N, KB], F32), C: T.Tensor([M, N], BF16)):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            T.use_swizzle(swizzle)
            a_sw128 = T.alloc_shared([stages, BM, BK], FP8)     # 128-byte-swizzled tiles (BK = 128 rows)
            b_sw128 = T.alloc_shared([stages, BN, BK], FP8)
            sa = T.alloc_shared([stages, BM, SB], F32)
            sb = T.alloc_shared([stages, BN, SB], F32)
            full = T.alloc_barrier(arrive_count=[128] * stages)
            empty = T.alloc_barrier(arrive_count=[128 * consumers] * stages)
            done = T.alloc_barrier(arrive_count=128 * consumers)
            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                consumer(0, a_sw128, b_sw128, sa, sb, full, empty, done, C, bx, by)
            elif tx < 256:
                T.set_max_nreg(nreg[0], 1)
                consumer(1, a_sw128, b_sw128, sa, sb, full, empty, done, C, bx, by)
            elif consumers == 3 and tx < 384:
                T.set_max_nreg(nreg[0], 1)
                consumer(2, a_sw128, b_sw128, sa, sb, full, empty, done, C, bx, by)
            else:
                T.set_max_nreg(nreg[1], 0)
                for k in T.serial(NK):
                    load(k, k, bx, by, a_sw128, b_sw128, sa, sb, full, empty, A, As, Bm, Bs)

    return compile_kernel(fp8_gemm_halves, out_idx=[4])
