"""Sparse attention forward (SPEC §10.5) on 2-CTA clusters that split D: ``fwd_kernel_cl``, H = 64.

Same contract as the other forwards (``sparse_attn_tl``): the running max moves once per 64-slot block and P is
rounded to bf16 against that block's max, as the release does; only fp32 summation orders differ (here: each score
is the sum of two partial dot products over D halves, and the probability sum is one chain over the blocks).

Why. ``fwd_kernel_pp`` splits one query's blocks between two consumer warpgroups (a query's 64 x 512 fp32 output
is 256 registers a thread for one warpgroup), so a pair of blocks is one serial chain that crosses both consumers
(S0 -> softmax -> P0 -> softmax -> P1 -> rescale -> P V -> next QK) and an SM has nothing else to run while a link
waits: ~8500 cycles a pair against ~4100 of tensor work (H100 run 76's trace). Here a CTA holds only its D half
(rank r of the cluster: columns [r D/2, (r + 1) D/2)) of Q, of the gathered KV rows and of O, so one warpgroup's
output is 64 x 256 (128 registers), and each of a CTA's two consumer warpgroups owns a different query: two
independent chains per SM, as FlashAttention-3's two query tiles.

Per block j of a consumer's query (both CTAs of the cluster run the same query's block j on their halves):

    S_r = Q[:, half r] K_j[:, half r]^T        (m64n64, K = D/2; -inf seeded at holes)
    send S_r to the peer (st.async into its ``recv`` buffer, completing bytes on its ``xbar``), wait for S_{1-r}
    S = S_r + S_{1-r}                          (fp32 addition commutes: both CTAs hold the same bits)
    m' = max(m, rowmax S); P = bf16(exp2(c S - c m')); l = l exp2(c (m - m')) + rowsum exp2(c S - c m')
    O_r = O_r exp2(c (m - m')) + P V_j[:, half r]   (P from registers)

so both CTAs compute the same softmax (the same m, P, l bit for bit) and each its output half. A partial score
travels as the thread's own 32 accumulator registers, in register order, to the same thread of the peer's same
warpgroup (whose fragment layout is the same), so no layout is assumed. The receiver hands its buffer back
(``xfree``, a remote arrival on the sender's barrier) once every thread has added it.

Roles (384 threads). Warpgroups 0 and 1: consumers of query slots 0 and 1. Warpgroup 2: the producer, two
warps per slot: a slot's Q half (``q_ready``, again after ``q_free``), then its blocks' KV rows (the CTA's half
of each, 512 bytes a row at D = 512) into the slot's two stages (``kv_ready`` / ``kv_free``), with a hole flag a
row (holes are zero-filled by the copy's bounds check, not read). Persistent: ``ctas`` CTAs (an even number, the SM
count), slot w of cluster g taking queries 2 g + w, 2 g + w + ctas, ...; every barrier's phase runs on across
a slot's queries. O (bf16) is staged in the last block's stage and stored by TMA; rank 0 stores the LSE.

Shared memory (D = 512): Q halves 2 x 32 KB, stages 2 slots x 2 x 32 KB, receive buffers 2 x 16 KB, hole flags
1 KB: with the static barriers (padded to 1 KB) exactly the 227 KB a CTA may have, so nothing more fits.

Measured (BENCHMARKS runs 77-79): correct (cosine diff <= 2e-8 against the reference, relaunches bitwise equal),
but SLOWER than pp: 371 TFLOP/s on the H200 (pp 507-513 in the same process), 380-382 on an H100 (pp 474-504).
Where the time goes (H100 trace and ablations at the release shape): a block takes ~5000 cycles of a consumer's
chain, of which the exchange (the peer's partial scores, from the end of the QK to the sum) ~1300-1500, the QK
~1200 and the softmax with the P V ~1700; without the exchange the same kernel runs 481 (wrong outputs), without
it and without the gathers 556. The exchange ties each chain to the peer CTA's same chain block by block, so its
latency (and any skew between the two CTAs) sits on the chain, and two chains an SM do not hide it. A pipelined
schedule (blocks in pairs, FlashAttention-3's overlap of the next QK with the softmax and of a P V with the next
exchange; commit e6d78fc) needed a second score tile (240 registers a consumer, the producer spilling at 24) and ran
284-312 on the H100, slower still; it was removed. Kept as ``impl="cl"`` (opt-in, ``sparse_attn_tl._fwd``): the
working D-split design, its tests and its bench section (``kernels.bench --only attncl``) for whoever takes the
exchange further (e.g. a bulk DSMEM copy by one thread instead of 1024 ``st.async`` a block, which needs 16 KB of
send buffer that does not fit beside two queries' stages).
"""
import functools

import tilelang.language as T

from ._common import LOG2E, check_nreg, compile_kernel, softmax_macros
from .sparse_attn_tl import BF16, F32, I32

# A thread's 32 fp32 partial scores (its m64n64 accumulator registers, in register order) to the same thread of
# the peer CTA: the peer's buffer is [8][128][4] fp32 (16-byte rows, one per thread and register quad, so a
# warp's loads are conflict-free), each st.async completing 16 bytes on the peer's barrier.
_XCHG_SRC = r"""
__device__ __forceinline__ unsigned dsv41_mapa(const void* p, int peer) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p)), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(peer));
  return r;
}
__device__ __forceinline__ void dsv41_send_s32(const float* v, void* buf, void* bar, int peer, int t) {
  const unsigned rb = dsv41_mapa(buf, peer) + t * 16, rbar = dsv41_mapa(bar, peer);
#pragma unroll
  for (int k = 0; k < 8; ++k)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(rb + k * 2048), "f"(v[4 * k]), "f"(v[4 * k + 1]), "f"(v[4 * k + 2]), "f"(v[4 * k + 3]),
                    "r"(rbar) : "memory");
}
__device__ __forceinline__ void dsv41_add_s32(float* v, const void* buf, int t) {
  const float4* p = reinterpret_cast<const float4*>(buf) + t;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float4 r = p[k * 128];
    v[4 * k] += r.x; v[4 * k + 1] += r.y; v[4 * k + 2] += r.z; v[4 * k + 3] += r.w;
  }
}
__device__ __forceinline__ void dsv41_arrive_expect_tx(void* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
}
"""


def _cl_smem(H: int, D: int, BI: int) -> int:
    """fwd_kernel_cl's shared memory in bytes (one CTA: its D half): Q halves, stages, receive buffers, hole flags."""
    DH = D // 2
    return 2 * H * DH * 2 + 4 * BI * DH * 2 + 2 * H * BI * 4 + 2 * 2 * BI * 4


@functools.lru_cache(maxsize=None)
def fwd_kernel_cl(H: int, D: int, TP: int, scale: float, ctas: int, BI: int = 64, nreg: tuple = (232, 40),
                  diag: str = ""):
    """o, lse = fwd(q, kv, sink, idx) on ``ctas`` CTAs in 2-CTA clusters (384 threads each); H == 64, BI == 64,
    TP a multiple of BI. Outputs as ``sparse_attn_tl.fwd_kernel``: o [B, M, H, D] bf16, lse [B, M, H] fp32
    (log2 units of the scaled logits, sink included).

    ``diag`` (benchmark ablations only, wrong outputs; "+"-joined): "noxchg" = no score exchange (each CTA's softmax
    over its own partial scores); "compute" = each slot's producer gathers its first query's first two blocks only
    and then re-signals the stages (stale rows: no gather latency); "trace" = the normal kernel, but rank 0's
    consumers write clock64() stamps (cycles since the CTA's start) into their query's LSE row instead of the LSE:
    slot 4 j + 0..3 = block j's stage ready, its QK done, its exchange done, its P V done (TP <= 640), 40 = the
    epilogue done."""
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if H != 64 or BI != 64:
        raise ValueError("fwd_kernel_cl: H and BI must be 64 (one warpgroup's m64n64 score tile)")
    if D % 128 or D > 512:
        raise ValueError("fwd_kernel_cl: D must be a multiple of 128, <= 512")
    if TP % BI:
        raise ValueError("fwd_kernel_cl: TP must be a multiple of BI")
    if _cl_smem(H, D, BI) > 227 * 1024 - 1024:
        raise ValueError("fwd_kernel_cl: shared memory over 227 KB")
    if not isinstance(ctas, int) or ctas < 2 or ctas % 2:
        raise ValueError(f"fwd_kernel_cl: ctas must be an even number >= 2 (2-CTA clusters), got {ctas!r}")
    check_nreg("fwd_kernel_cl", nreg)
    DG = set(diag.split("+")) - {""}
    if DG - {"noxchg", "compute", "trace"}:
        raise ValueError(f"fwd_kernel_cl: diag {diag!r}")
    XC = "noxchg" not in DG
    GA = "compute" not in DG
    TR = "trace" in DG
    if TR and TP > 640:
        raise ValueError("fwd_kernel_cl: diag='trace' keeps 4 stamps a block in the 64 LSE slots: TP <= 640")
    NI = TP // BI
    DH = D // 2
    c = float(scale) * LOG2E
    _, probs = softmax_macros(H, BI, c)
    XB = H * BI * 4                     # bytes of one partial score tile
    CPR = DH // 8 // 8                  # 16-byte chunks a producer thread copies per row (8 threads a row)

    def n_queries(slot):
        """Queries of query slot ``slot`` (slot, slot + ctas, ...; 0 where the grid outnumbers them)."""
        return (B * M - slot + ctas - 1) // ctas

    @T.macro
    def stamp(slot, t0s, Lse, bi, mi, r, t):
        if TR:
            if r == 0:
                if t == 0:
                    Lse[bi, mi, slot] = T.cast(T.call_extern("int64", "clock64") - t0s[0], F32)

    @T.macro
    def issue_qk(w, s, z, acc, q_s, kv_s):
        """S_r of the block in stage s into acc (a hole's row is zero-filled: 0 there); issued, not waited for."""
        T.wgmma_gemm(q_s[z + w, :, :], kv_s[z + w * 2 + s, :, :], acc, transpose_B=True, clear_accum=True)

    @T.macro
    def mask_holes(w, s, acc, hole_s):
        """S = -inf at the holes of the block in stage s, skipped (warp-uniform) when the block has none: bit 0 of
        hole_s[w, s, u] flags slot u, bit 1 of slots 0 and 4 says whether the producer's warp 0 / 1 saw any hole
        (no extra buffer: one more would cost a 1 KB-aligned slot of the full shared memory)."""
        if T.bitwise_and(T.bitwise_or(hole_s[w, s, 0], hole_s[w, s, 4]), 2) != 0:
            for h, u in T.Parallel(H, BI):
                acc[h, u] = T.if_then_else(T.bitwise_and(hole_s[w, s, u], 1) != 0, -T.infinity(F32), acc[h, u])

    @T.macro
    def send(w, r, t, gb, acc, recv_s, xbar, xfree):
        """The slot's gb-th partial scores (acc, complete) to the peer's recv_s[w], once the peer has added the
        previous ones (xfree); arms this CTA's xbar for the peer's."""
        if XC:
            T.barrier_wait(xfree[w], (gb % 2) ^ 1)
            if t == 0:
                T.call_extern("handle", "dsv41_arrive_expect_tx", T.address_of(xbar[w]), XB)
            T.call_extern("handle", "dsv41_send_s32", acc.data, T.address_of(recv_s[w, 0, 0, 0]),
                          T.address_of(xbar[w]), 1 - r, t)

    @T.macro
    def receive(w, r, t, gb, acc, recv_s, xbar, xfree):
        """acc += the peer's gb-th partial scores; then recv_s[w] is handed back (xfree, on the peer)."""
        if XC:
            T.barrier_wait(xbar[w], gb % 2)
            T.call_extern("handle", "dsv41_add_s32", acc.data, T.address_of(recv_s[w, 0, 0, 0]), t)
            T.sync_threads(10 + w, 128)                 # every thread has read recv_s[w] (ids 10-13: TileLang's own from 3)
            if t == 0:
                T.mbarrier_arrive(xfree[w], 1 - r)

    @T.macro
    def softmax(acc, m, m1, a, ls, l):
        """The release's block recurrence: m1 = max(m, rowmax S), a = exp2(c (m - m1)), acc <- exp2(c S - c m1)
        (fp32), l = l a + rowsum acc; m <- m1."""
        T.copy(m, m1)
        T.reduce_max(acc, m1, dim=1, clear=False)
        probs(acc, m, m1, a, ls, l)
        T.copy(m1, m)

    @T.macro
    def epilogue(w, r, t, k, acc_o, l, m, lo, kv_s, kv_free, t0s, Sink, O, Lse, bi, mi):
        """The sink in the denominator, the O half through the last block's stage (TMA store), LSE (rank 0)."""
        s_last = (k * NI + NI - 1) % 2
        for h in T.Parallel(H):
            l[h] = l[h] + T.exp2(Sink[h] * LOG2E - m[h] * c)
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] /= l[h]
        T.copy(acc_o, kv_s[w * 2 + s_last, :, :])
        T.copy(kv_s[w * 2 + s_last, :, :], O[bi, mi, :, r * DH:(r + 1) * DH])
        T.sync_threads(12 + w, 128)                     # the store's reads are done (its issuing thread waited)
        T.barrier_arrive(kv_free[w * 2 + s_last])
        if not TR:
            if r == 0:
                for h in T.Parallel(H):
                    lo[h] = T.log2(l[h]) + m[h] * c
                T.copy(lo, Lse[bi, mi, :])
        stamp(40, t0s, Lse, bi, mi, r, t)

    @T.macro
    def blocks(w, r, t, k, z, zs, acc_s, p, acc_o, m, m1, a, ls, l, q_s, kv_s, recv_s, hole_s, q_free, kv_ready,
               kv_free, xbar, xfree, t0s, Lse, bi, mi):
        """One block after the other: QK, exchange, softmax, P V, each waited for."""
        for j in T.serial(NI):
            g = k * NI + j                              # the slot's block count: stage g % 2, phases run on
            s = g % 2
            z = zs[0]                                   # 0, unknown to ptxas: no WGMMA descriptor is hoisted
            T.barrier_wait(kv_ready[w * 2 + s], (g // 2) % 2)
            stamp(4 * j, t0s, Lse, bi, mi, r, t)
            issue_qk(w, s, z, acc_s, q_s, kv_s)
            T.wait_wgmma(0)
            if j == NI - 1:
                T.barrier_arrive(q_free[w])             # the slot's last QK of this query: Q may be reloaded
            stamp(4 * j + 1, t0s, Lse, bi, mi, r, t)
            send(w, r, t, g, acc_s, recv_s, xbar, xfree)
            receive(w, r, t, g, acc_s, recv_s, xbar, xfree)
            mask_holes(w, s, acc_s, hole_s)
            stamp(4 * j + 2, t0s, Lse, bi, mi, r, t)
            softmax(acc_s, m, m1, a, ls, l)
            T.copy(acc_s, p)
            for h, d in T.Parallel(H, DH):
                acc_o[h, d] *= a[h]
            T.wgmma_gemm(p, kv_s[z + w * 2 + s, :, :], acc_o)
            T.wait_wgmma(0)
            stamp(4 * j + 3, t0s, Lse, bi, mi, r, t)
            if j < NI - 1:
                T.barrier_arrive(kv_free[w * 2 + s])

    @T.macro
    def consumer(w, r, NQ, t0s, zs, q_s, kv_s, recv_s, hole_s, q_ready, q_free, kv_ready, kv_free, xbar, xfree, Sink,
                 O, Lse, slot0):
        acc_s = T.alloc_fragment([H, BI], F32)
        p = T.alloc_fragment([H, BI], BF16)
        acc_o = T.alloc_fragment([H, DH], F32)
        m = T.alloc_fragment([H], F32)
        m1 = T.alloc_fragment([H], F32)
        a = T.alloc_fragment([H], F32)
        ls = T.alloc_fragment([H], F32)
        l = T.alloc_fragment([H], F32)
        lo = T.alloc_fragment([H], F32)
        z = T.alloc_var(I32)
        bm = T.alloc_local([2], I32)                    # the query's (batch, row), computed once a query
        T.set_max_nreg(nreg[0], 1)
        t = T.get_thread_binding() % 128
        T.import_source(_XCHG_SRC)
        for k in T.serial(NQ):
            n = slot0 + k * ctas
            # n // M, n % M are divisions by a runtime M; a Python name bound to the expression would re-evaluate
            # them at every use (a macro substitutes its argument expressions), so they go into registers once
            bm[0] = n // M
            bm[1] = n % M
            bi, mi = bm[0], bm[1]
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, -1e30)
            T.barrier_wait(q_ready[w], k % 2)
            blocks(w, r, t, k, z, zs, acc_s, p, acc_o, m, m1, a, ls, l, q_s, kv_s, recv_s, hole_s, q_free, kv_ready,
                   kv_free, xbar, xfree, t0s, Lse, bi, mi)
            epilogue(w, r, t, k, acc_o, l, m, lo, kv_s, kv_free, t0s, Sink, O, Lse, bi, mi)

    @T.macro
    def producer(w, r, NQ, q_s, kv_s, hole_s, q_ready, q_free, kv_ready, kv_free, Q, KV, Idx, slot0):
        """Warps 2w, 2w + 1 of warpgroup 2 (64 threads): slot w's Q halves and KV row halves."""
        tp = T.get_thread_binding() % 64
        src = T.alloc_local([BI // 8], I32)
        nh = T.alloc_local([1], I32)
        bm = T.alloc_local([2], I32)                    # the query's (batch, row), once a query (as the consumers')
        for k in T.serial(NQ):
            n = slot0 + k * ctas
            bm[0] = n // M
            bm[1] = n % M
            bi, mi = bm[0], bm[1]
            if k > 0:
                T.barrier_wait(q_free[w], (k - 1) % 2)
            for i in T.unroll(H // 8):                  # Q[:, half r]: 8 threads a row, 8 rows a pass
                for u in T.unroll(CPR):
                    col = u * 64 + (tp % 8) * 8
                    T.ptx_cp_async(T.access_ptr(q_s[w, i * 8 + tp // 8, col], "w", 8),
                                   T.access_ptr(Q[bi, mi, i * 8 + tp // 8, r * DH + col], "r", 8), 8)
            T.cp_async_barrier_noinc(q_ready[w])
            for j in T.serial(NI):
                g = k * NI + j
                s = g % 2
                for i in T.unroll(BI // 8):
                    src[i] = Idx[bi, mi, j * BI + i * 8 + tp // 8]
                T.barrier_wait(kv_free[w * 2 + s], ((g // 2) % 2) ^ 1)
                if GA or g < 2:
                    nh[0] = 0
                    for i in T.unroll(BI // 8):
                        nh[0] = nh[0] | T.if_then_else(src[i] < 0, 1, 0)
                    nh[0] = T.if_then_else(T.any_sync(nh[0]) != 0, 2, 0)   # bit 1: any hole among the warp's rows
                    if tp % 8 == 0:
                        for i in T.unroll(BI // 8):
                            hole_s[w, s, i * 8 + tp // 8] = T.if_then_else(src[i] < 0, 1, 0)
                    if tp % 32 == 0:                    # tp 0 / 32: slot 0 / 4 (their row i = 0) with the warp's bit
                        hole_s[w, s, tp // 8] = T.if_then_else(src[0] < 0, 1, 0) + nh[0]
                    for i in T.unroll(BI // 8):         # a hole (-1) fails the bounds check: zero-filled, not read
                        for u in T.unroll(CPR):
                            col = u * 64 + (tp % 8) * 8
                            T.ptx_cp_async(T.access_ptr(kv_s[w * 2 + s, i * 8 + tp // 8, col], "w", 8),
                                           T.access_ptr(KV[bi, src[i], r * DH + col], "r", 8), 8)
                    T.cp_async_barrier_noinc(kv_ready[w * 2 + s])
                    T.barrier_arrive(kv_ready[w * 2 + s])   # the hole flags (generic stores) are released
                else:
                    T.barrier_arrive(kv_ready[w * 2 + s])
                    T.barrier_arrive(kv_ready[w * 2 + s])

    @T.prim_func
    def sparse_attn_fwd_cl(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        Sink: T.Tensor([H], F32),
        Idx: T.Tensor([B, M, TP], I32),
        O: T.Tensor([B, M, H, D], BF16),
        Lse: T.Tensor([B, M, H], F32),
    ):
        with T.Kernel(ctas, threads=384, cluster_dims=(2, 1, 1)) as bx:
            q_s = T.alloc_shared([2, H, DH], BF16)
            kv_s = T.alloc_shared([4, BI, DH], BF16)
            recv_s = T.alloc_shared([2, 8, 128, 4], F32)
            hole_s = T.alloc_shared([2, 2, BI], I32)    # a hole flag a slot (+ a block flag, mask_holes)
            zs = T.alloc_shared([1], I32)
            t0s = T.alloc_shared([1], "int64")          # diag="trace": the CTA's start (clock64)
            q_ready = T.alloc_barrier(arrive_count=[64] * 2)
            q_free = T.alloc_barrier(arrive_count=[128] * 2)
            kv_ready = T.alloc_barrier(arrive_count=[128] * 4)    # 64 cp.async (noinc) + 64 plain arrivals
            kv_free = T.alloc_barrier(arrive_count=[128] * 4)
            xbar = T.alloc_barrier(arrive_count=[1] * 2)           # + the peer's 16 KB of st.async bytes
            xfree = T.alloc_cluster_barrier([1] * 2)               # the peer's thread 0 of the slot
            r = T.block_rank_in_cluster()
            cl = bx // 2
            tx = T.get_thread_binding()
            if tx == 0:
                zs[0] = 0
                if TR:
                    t0s[0] = T.call_extern("int64", "clock64")
            T.sync_threads()
            if tx < 128:
                consumer(0, r, n_queries(2 * cl), t0s, zs, q_s, kv_s, recv_s, hole_s, q_ready, q_free, kv_ready,
                         kv_free, xbar, xfree, Sink, O, Lse, 2 * cl)
            elif tx < 256:
                consumer(1, r, n_queries(2 * cl + 1), t0s, zs, q_s, kv_s, recv_s, hole_s, q_ready, q_free, kv_ready,
                         kv_free, xbar, xfree, Sink, O, Lse, 2 * cl + 1)
            else:
                T.set_max_nreg(nreg[1], 0)
                if tx < 320:
                    producer(0, r, n_queries(2 * cl), q_s, kv_s, hole_s, q_ready, q_free, kv_ready, kv_free, Q, KV,
                             Idx, 2 * cl)
                else:
                    producer(1, r, n_queries(2 * cl + 1), q_s, kv_s, hole_s, q_ready, q_free, kv_ready, kv_free, Q,
                             KV, Idx, 2 * cl + 1)
            T.cluster_sync()                            # the peer's last remote stores / arrivals landed

    return compile_kernel(sparse_attn_fwd_cl, out_idx=[4, 5])


def cl_fits(H: int, D: int, TP: int, BI: int = 64) -> bool:
    """fwd_kernel_cl's shapes: 64 heads, D a multiple of 128 up to 512, TP a multiple of 64."""
    return H == 64 and D % 128 == 0 and D <= 512 and TP % BI == 0 and _cl_smem(H, D, BI) <= 227 * 1024 - 1024
