"""Sparse attention forward with FlashMLA's "seesaw" schedule (``sparse_attn_tl._fwd(impl="seesaw")``), H = 64.

Same contract and numerics as the forwards in ``sparse_attn_tl`` (whose producer steps and epilogue it shares),
except that the running max moves once per BI-slot block: each consumer warpgroup computes S of every other
BI-slot block (m64nBI QK) and owns a D half of the output; the two alternate their softmaxes so one's
exponentials overlap the other's WGMMAs, and they meet once per block (the max of the last block is passed
on). BI = 64 is the release's blocking exactly.

Measured (H200 run 17, release shape): 164 TFLOP/s at BI = 64 / 2 stages, 278 at BI = 32 / 4 stages, below
``fwd_kernel_ws``'s 365: ptxas spills 0.4-2.3 KB at D = 512 (the precomputed WGMMA descriptors, reloaded at
every QK) and with 2 stages of 64 slots the gather cannot run ahead. Nsight Compute on ``ws`` (run 16):
tensor pipe 41% busy, no eligible warp in 70% of cycles, L2 at 22% - latency-bound, which is what this
schedule is for once the spills are gone. Not the default.
"""
import functools

import tilelang.language as T

from ._common import LOG2E, check_nreg, compile_kernel, softmax_macros
from .sparse_attn_tl import BF16, F32, I32, _ws_epilogue, _ws_gather


@functools.lru_cache(maxsize=None)
def fwd_kernel_seesaw(H: int, D: int, TP: int, scale: float, BI: int = 64, stages: int = 2, nreg: tuple = (240, 24),
                      seed: bool = True, unroll: bool = True, qk_split: int = 1):
    """o, lse = fwd(q, kv, sink, idx), "seesaw" schedule (384 threads); H == 64, TP a multiple of 2 * BI.

    Roles. Warpgroup 2, the producer (``nreg[1]`` registers), loads Q once, then gathers the KV rows of
    index block j (BI slots) into shared stage j % stages with cp.async, together with the block's 32-bit
    indices (so the consumers seed their QK accumulators with the hole mask from shared memory, not from
    global loads); ``full[s]`` signals the stage, ``empty[s]`` (both consumers) frees it.
    Consumer 0 owns output columns [0, D/2) and computes S = Q K^T of the EVEN blocks, consumer 1 owns
    [D/2, D) and the ODD blocks (m64 n_BI k_D WGMMAs, Q read from shared memory). Per pair i (blocks
    2i, 2i+1), with m the running max after block 2i-1:
      WG0: m0 = max(m, rowmax S0); P0 = bf16(exp2(c S0 - c m0)); publish P0, m0 (bar_p0);
           O_L = O_L exp2(c (m - m0)) + P0 V_2i[:, L]; wait P1, m1 (bar_p1);
           O_L = O_L exp2(c (m0 - m1)) + P1 V_2i+1[:, L]  (the next even QK is issued before this wait
           with >= 4 stages, right after this PV with 2: block 2i+2 then refills block 2i's stage).
      WG1: (S1 in flight) wait P0, m0; O_R = O_R exp2(c (m - m0)) + P0 V_2i[:, R] (issued before its
           softmax, which then overlaps that PV); m1 = max(m0, rowmax S1); P1 = bf16(exp2(c S1 - c m1));
           publish P1, m1; O_R = O_R exp2(c (m0 - m1)) + P1 V_2i+1[:, R]; issue the next odd QK.
    So one consumer's softmax runs while the other's WGMMAs keep the tensor cores busy, and the two
    meet once per block, not twice per pair. Both compute the rescale factors themselves from the
    exchanged maxima (same fp32 expression, identical bits).

    Numerics: exactly the recurrence of ``reference.sparse_attn(block=BI)`` - the running max moves
    once per BI-slot block, P is rounded to bf16 against that block's max. Each consumer keeps the fp32
    probability sum of its own blocks, rescaled by every factor it applies to its output half; the
    two sums (under the same final max) are added with the sink exp2(sink log2e - c m) at the end;
    LSE = log2(l) + c m as ``fwd_kernel``. Holes gather row 0 (finite) with S seeded -inf: p exactly 0.

    Buffer reuse: P0 / m0 (P1 / m1) may be rewritten only after the other consumer's PV that reads
    them completed (``free0`` / ``free1``, pre-arrived once); a stage is released by each consumer
    after its last WGMMA on it completed. Shared memory: Q + stages * BI * D * 2 + 2 * 64 * BI * 2
    bytes (BI = 64, 2 stages: 208 KB; BI = 32, 4 stages: 200 KB).

    Knobs for the bench: ``seed`` (hole mask as the QK accumulator's seed, else applied after the QK),
    ``unroll`` (pair loop unrolled; a runtime loop makes ptxas serialise the WGMMAs, C7514),
    ``qk_split`` (QK issued as that many commit groups over D slices). ptxas (CUDA 13.0) spills at
    D = 512 (BI 64: 2268 B, qk_split 4: 1716 B, BI 32: 440 B; none at D <= 256): the SASS shows the
    spilled values are precomputed 64-bit WGMMA descriptors reloaded (LDL.64 -> R2UR) at each QK.

    Registers: ``setmaxnreg`` moves registers within the CTA's pool, which is what the launch allocated:
    ptxas gives a 384-thread kernel with setmaxnreg 168 registers a thread (65536 / 384 rounded down to
    8), 3 * 168 = 504 per 128-thread row, so 2 * nreg[0] + nreg[1] must be <= 504. (240, 32) asked for
    512: the second consumer's ``setmaxnreg.inc`` waited forever for 1024 registers (the H200 hang of
    the first version). The producer needs no more than 24 (same ptxas spill figures as with 32).
    """
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if H != 64:
        raise ValueError("fwd_kernel_seesaw: H must be 64 (one warpgroup's WGMMA M)")
    if D % 128 or D > 512:
        raise ValueError("fwd_kernel_seesaw: D must be a multiple of 128, <= 512")
    if TP % (2 * BI) or stages < 2 or BI % 16:
        raise ValueError("fwd_kernel_seesaw: TP a multiple of 2*BI, stages >= 2, BI a multiple of 16")
    if (H + stages * BI) * D * 2 + 2 * H * BI * 2 + stages * BI * 4 > 227 * 1024 - 2048:
        raise ValueError("fwd_kernel_seesaw: shared memory over 227 KB")
    check_nreg("fwd_kernel_seesaw", nreg)
    NI = TP // BI
    NP = NI // 2
    NS = stages
    DH = D // 2
    c = float(scale) * LOG2E
    factor, probs = softmax_macros(H, BI, c)
    epilogue = _ws_epilogue(H, DH, c)
    CPR = D // 64                       # 16-byte chunks a producer thread copies per row (8 threads a row)
    load_q, gather_kv = _ws_gather(H, BI, CPR)
    QG = int(qk_split)                  # commit groups a QK is issued in (fewer live WGMMA descriptors)
    DK = D // QG
    if D % QG or DK % 64 or (QG > 1 and not seed):
        raise ValueError("fwd_kernel_seesaw: qk_split must cut D into multiples of 64 (and needs seed)")

    # With >= 4 stages the next pair's blocks have their own stages: each consumer issues its next QK
    # right behind its PVs. With 2 stages (BI = 64) block 2i+2 refills block 2i's stage, so consumer 0
    # issues S of 2i+2 after its PV1 (the gather overlaps block 2i+1's work) and consumer 1 releases
    # block 2i+1 before waiting for 2i+3 (issuing them earlier would wait on their own release).
    EARLY = NS >= 4

    def st(j):
        """Stage of block j."""
        return j % NS

    def ph(j):
        """Parity of block j's use of its stage."""
        return (j // NS) % 2

    @T.macro
    def issue_qk(j, acc_s, q_s, kv_s, idx_s, full):
        """S = (0 or -inf per slot) + Q K_j^T into acc_s (seed; else plain Q K_j^T, masked by
        ``mask`` once complete); asynchronous (T.wait_wgmma)."""
        T.barrier_wait(full[st(j)], ph(j))
        if seed:
            for h, t in T.Parallel(H, BI):
                acc_s[h, t] = T.if_then_else(idx_s[st(j), t] >= 0, 0, -T.infinity(F32))
        if QG == 1:
            T.wgmma_gemm(q_s, kv_s[st(j), :, :], acc_s, transpose_B=True, clear_accum=not seed)
        else:                               # QG commit groups over D slices (a runtime loop)
            for kc in T.serial(QG):
                T.wgmma_gemm(q_s[:, kc * DK:(kc + 1) * DK], kv_s[st(j), :, kc * DK:(kc + 1) * DK], acc_s,
                             transpose_B=True)

    @T.macro
    def mask(j, acc_s, idx_s):
        """Holes of block j to -inf (after its QK completed; only without ``seed``)."""
        if not seed:
            for h, t in T.Parallel(H, BI):
                acc_s[h, t] = T.if_then_else(idx_s[st(j), t] >= 0, acc_s[h, t], -T.infinity(F32))

    @T.macro
    def pair0(i, first, last, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, full, empty,
              bar_p0, bar_p1, free0, free1):
        """Consumer 0, pair i: S of block 2i is in flight in acc_s (and, unless first, PV1 of pair i-1)."""
        j0 = 2 * i
        j1 = 2 * i + 1
        if EARLY and not first:
            T.wait_wgmma(1)                             # S0 done, PV1 of pair i-1 may still run
        else:
            T.wait_wgmma(0)                             # (2 stages: S0 was issued after PV1 of pair i-1)
            if not first:                               # PV1 of pair i-1 done: its stage and P1 are free
                T.barrier_arrive(empty[st(j0 - 1)])
                T.barrier_arrive(free1)
        mask(j0, acc_s, idx_s)
        T.copy(m, m0)
        T.reduce_max(acc_s, m0, dim=1, clear=False)    # m0 = max(m, rowmax S0)
        probs(acc_s, m, m0, a, ls, l)                   # a = alpha = exp2(c (m - m0)), P0, l
        T.barrier_wait(free0, i % 2)                   # consumer 1 is done with P0 / m0 of pair i-1
        T.copy(acc_s, p_s[0, :, :])
        T.copy(m0, mx_s[0, :])
        T.fence_proxy_async()                           # P: generic stores, read next by WGMMA (async proxy)
        T.barrier_arrive(bar_p0)
        if EARLY and not first:
            T.wait_wgmma(0)                             # PV1 of pair i-1 done: its stage and P1 are free
            T.barrier_arrive(empty[st(j0 - 1)])
            T.barrier_arrive(free1)
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] *= a[h]
        T.wgmma_gemm(p_s[0, :, :], kv_s[st(j0), :, 0:DH], acc_o)
        if EARLY and not last:                          # block 2i+2 has its own stage
            issue_qk(j0 + 2, acc_s, q_s, kv_s, idx_s, full)
        T.barrier_wait(bar_p1, i % 2)                  # P1, m1 of pair i
        for h in T.Parallel(H):
            m[h] = mx_s[1, h]
        factor(a, m0, m)                                # beta
        for h in T.Parallel(H):
            l[h] = l[h] * a[h]
        if EARLY and not last:
            T.wait_wgmma(QG)                            # PV0 done, the next S0 may still run
        else:
            T.wait_wgmma(0)
        T.barrier_arrive(empty[st(j0)])
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] *= a[h]
        T.barrier_wait(full[st(j1)], ph(j1))
        T.wgmma_gemm(p_s[1, :, :], kv_s[st(j1), :, 0:DH], acc_o)
        if not EARLY and not last:                      # 2 stages: block 2i+2 refills block 2i's
            issue_qk(j0 + 2, acc_s, q_s, kv_s, idx_s, full)

    @T.macro
    def pair1(i, first, last, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, full, empty,
              bar_p0, bar_p1, free0, free1):
        """Consumer 1, pair i: S of block 2i+1 is in flight in acc_s (with 4+ stages and unless first,
        PV1 of pair i-1 too)."""
        j0 = 2 * i
        j1 = 2 * i + 1
        T.barrier_wait(bar_p0, i % 2)                  # P0, m0 of pair i
        if EARLY:
            T.wait_wgmma(QG)                            # PV1 of pair i-1 done, S1 may still run
            if not first:
                T.barrier_arrive(empty[st(j1 - 2)])
        for h in T.Parallel(H):
            m0[h] = mx_s[0, h]
        factor(a, m, m0)                                # alpha
        for h in T.Parallel(H):
            l[h] = l[h] * a[h]
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] *= a[h]
        T.barrier_wait(full[st(j0)], ph(j0))
        T.wgmma_gemm(p_s[0, :, :], kv_s[st(j0), :, DH:D], acc_o)
        T.wait_wgmma(1)                                 # S1 done; PV0 runs under the softmax
        mask(j1, acc_s, idx_s)
        T.copy(m0, m)
        T.reduce_max(acc_s, m, dim=1, clear=False)     # m1 = max(m0, rowmax S1)
        probs(acc_s, m0, m, a, ls, l)                   # a = beta = exp2(c (m0 - m1)), P1, l
        T.barrier_wait(free1, i % 2)                   # consumer 0 is done with P1 / m1 of pair i-1
        T.copy(acc_s, p_s[1, :, :])
        T.copy(m, mx_s[1, :])
        T.fence_proxy_async()
        T.barrier_arrive(bar_p1)
        T.wait_wgmma(0)                                 # PV0 done: P0 and (for me) stage 2i free
        T.barrier_arrive(empty[st(j0)])
        T.barrier_arrive(free0)
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] *= a[h]
        T.wgmma_gemm(p_s[1, :, :], kv_s[st(j1), :, DH:D], acc_o)
        if not last:
            if not EARLY:                               # 2 stages: block 2i+3 refills block 2i+1's
                T.wait_wgmma(0)
                T.barrier_arrive(empty[st(j1)])
            issue_qk(j1 + 2, acc_s, q_s, kv_s, idx_s, full)

    @T.macro
    def consumer(w, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, sum_s, bar_q, full, empty,
                 bar_p0, bar_p1, free0, free1, bar_end, Sink, O, Lse, bi, mi):
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, -1e30)
        if w == 0:
            T.barrier_arrive(free1)                     # pre-arrive: P1 / m1 buffers start free
        else:
            T.barrier_arrive(free0)
        T.barrier_wait(bar_q, 0)
        issue_qk(w, acc_s, q_s, kv_s, idx_s, full)
        pair = pair0 if w == 0 else pair1
        if NP == 1:
            pair(0, True, True, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, full, empty,
                 bar_p0, bar_p1, free0, free1)
        else:
            pair(0, True, False, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, full, empty,
                 bar_p0, bar_p1, free0, free1)
            for i in (T.unroll if unroll else T.serial)(NP - 2):
                pair(i + 1, False, False, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, full,
                     empty, bar_p0, bar_p1, free0, free1)
            pair(NP - 1, False, True, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, full, empty,
                 bar_p0, bar_p1, free0, free1)
        T.wait_wgmma(0)
        # both sums are under the same final max m (= m1 of the last pair); this exchange also tells
        # each consumer that the other is past its last WGMMA on q_s (reused for the output)
        T.copy(l, sum_s[w, :])
        T.barrier_arrive(bar_end)
        T.barrier_wait(bar_end, 0)
        epilogue(w, l, m, ls, acc_o, sum_s, q_s, Sink, O, Lse, bi, mi)

    @T.prim_func
    def sparse_attn_fwd_seesaw(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        Sink: T.Tensor([H], F32),
        Idx: T.Tensor([B, M, TP], I32),
        O: T.Tensor([B, M, H, D], BF16),
        Lse: T.Tensor([B, M, H], F32),
    ):
        with T.Kernel(M, B, threads=384) as (mi, bi):
            q_s = T.alloc_shared([H, D], BF16)
            kv_s = T.alloc_shared([NS, BI, D], BF16)
            idx_s = T.alloc_shared([NS, BI], I32)
            p_s = T.alloc_shared([2, H, BI], BF16)
            mx_s = T.alloc_shared([2, H], F32)
            sum_s = T.alloc_shared([2, H], F32)

            acc_s0 = T.alloc_fragment([H, BI], F32)
            acc_o0 = T.alloc_fragment([H, DH], F32)
            m_0 = T.alloc_fragment([H], F32)
            m0_0 = T.alloc_fragment([H], F32)
            a_0 = T.alloc_fragment([H], F32)
            ls_0 = T.alloc_fragment([H], F32)
            l_0 = T.alloc_fragment([H], F32)
            acc_s1 = T.alloc_fragment([H, BI], F32)
            acc_o1 = T.alloc_fragment([H, DH], F32)
            m_1 = T.alloc_fragment([H], F32)
            m0_1 = T.alloc_fragment([H], F32)
            a_1 = T.alloc_fragment([H], F32)
            ls_1 = T.alloc_fragment([H], F32)
            l_1 = T.alloc_fragment([H], F32)

            bar_q = T.alloc_barrier(arrive_count=128)
            full = T.alloc_barrier(arrive_count=[128] * NS)
            empty = T.alloc_barrier(arrive_count=[256] * NS)
            bar_p0 = T.alloc_barrier(arrive_count=128)
            bar_p1 = T.alloc_barrier(arrive_count=128)
            free0 = T.alloc_barrier(arrive_count=128)
            free1 = T.alloc_barrier(arrive_count=128)
            bar_end = T.alloc_barrier(arrive_count=256)

            tx = T.get_thread_binding()
            if tx < 128:                                 # 2 * nreg[0] + nreg[1] <= 504: the pool (docstring)
                T.set_max_nreg(nreg[0], 1)
                consumer(0, acc_s0, acc_o0, m_0, m0_0, a_0, ls_0, l_0, q_s, kv_s, idx_s, p_s, mx_s, sum_s, bar_q,
                         full, empty, bar_p0, bar_p1, free0, free1, bar_end, Sink, O, Lse, bi, mi)
            elif tx < 256:
                T.set_max_nreg(nreg[0], 1)
                consumer(1, acc_s1, acc_o1, m_1, m0_1, a_1, ls_1, l_1, q_s, kv_s, idx_s, p_s, mx_s, sum_s, bar_q,
                         full, empty, bar_p0, bar_p1, free0, free1, bar_end, Sink, O, Lse, bi, mi)
            else:
                T.set_max_nreg(nreg[1], 0)
                tp = tx - 256
                load_q(tp, q_s, Q, bi, mi, bar_q)
                for j in T.serial(NI):
                    s = st(j)
                    T.barrier_wait(empty[s], ph(j) ^ 1)
                    if tp < BI:                          # the block's indices (hole mask for the QK seed)
                        T.ptx_cp_async(T.access_ptr(idx_s[s, tp], "w", 1),
                                       T.access_ptr(Idx[bi, mi, j * BI + tp], "r", 1), 1)
                    gather_kv(tp, j, s, kv_s, KV, Idx, bi, mi)
                    T.cp_async_barrier_noinc(full[s])

    return compile_kernel(sparse_attn_fwd_seesaw, out_idx=[4, 5])
