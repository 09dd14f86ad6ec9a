"""Sparse attention forward (SPEC §10.5), "ping-pong" schedule: ``fwd_kernel_pp``, H = 64.

Same contract and numerics as the other forwards (``sparse_attn_tl``): the running max moves once per 64-slot
block and P is rounded to bf16 against that block's max, as the release does; only fp32 summation orders differ.

Why another schedule. ``fwd_kernel_sp`` (a softmax warpgroup feeding two PV warpgroups) is bound by one
warpgroup's serial QK -> softmax path (its docstring). Here, as in FlashMLA's Hopper sparse prefill, each of
two consumer warpgroups computes the QK and the softmax of every other block and the P V product of its own D
half for both blocks of a pair, so while one consumer runs its softmax the other's WGMMAs keep the tensor
cores busy. A producer warpgroup with few registers gathers the KV rows. What makes it work where
``fwd_kernel_seesaw`` (the same idea, 164-278 TFLOP/s) did not:

- every KV stage is tracked in D halves (left: columns [0, D/2), read by consumer 0's P V; right: consumer 1's),
  each with its own ready / free mbarrier, so a half is regathered as soon as its last reader is done and the
  QK of a block is issued in two commit groups, left half first;
- no WGMMA is in flight across the pair loop's back edge, so the loop stays rolled (a rolled loop with an
  in-flight WGMMA makes ptxas serialise every WGMMA, C7514; unrolled, ptxas hoists the loop-invariant WGMMA
  descriptors and spills them);
- the consumers get 216 registers, the producer 72 (setmaxnreg; 2 * 216 + 72 = 504, the pool of 384 threads).

Measured (H200 run 48, release shape): **482.8 / 466.6 TFLOP/s against sp's 468.0 / 452.8** in the same process
(2-4% faster at every slot count; 2560 random slots a query: 523.6 vs 512.4). Both split designs level off near
525 in the steady state, so what limits it now is inside a block's work, not the order of softmax and tensor
work. Next step, as FlashMLA does: the local P V as a register-operand WGMMA (P stays in the consumer's
registers: 8 KB less shared-memory traffic a block and no warpgroup barrier before it), and Q by TMA.
"""
import functools

import tilelang.language as T

from ._common import LOG2E, check_nreg, compile_kernel
from .sparse_attn_tl import BF16, F32, I32


def _pp_smem(H: int, D: int, TP: int, BI: int, rows: int = 1) -> int:
    """fwd_kernel_pp's shared memory in bytes: Q, two KV stages, P of both blocks of a pair, the index row(s)
    (two when persistent: the next query's is loaded during the current one)."""
    return (H + 2 * BI) * D * 2 + 2 * H * BI * 2 + rows * TP * 4 + 4 * H * 4


@functools.lru_cache(maxsize=None)
def fwd_kernel_pp(H: int, D: int, TP: int, scale: float, BI: int = 64, nreg: tuple = (216, 72), ctas: int = 0,
                  diag: str = ""):
    """o, lse = fwd(q, kv, sink, idx), ping-pong schedule (384 threads); H == 64, TP a multiple of 2 * BI.

    Roles. Warpgroup 2, the producer: copies the query's index row (``bar_i``) and Q (``bar_q``) into shared
    memory, then for each pair i gathers blocks 2i (stage 0) and 2i + 1 (stage 1) in D halves, in the order the
    halves are freed: (0, L), (0, R), (1, L), (1, R); ``ready[2 s + h]`` / ``free[2 s + h]``. Holes (-1) fail the
    copy's bounds check and are zero-filled without a read. Consumer 0 owns output columns L = [0, D/2), consumer 1
    R = [D/2, D). Pair i, with m the running max after block 2i - 1 (S0 of block 2i is already in consumer 0's
    accumulator):

      C0: m0 = max(m, rowmax S0); P0 = bf16(exp2(c S0 - c m0)); publish P0, m0 (``bar_p0``);
          O_L = O_L exp2(c (m - m0)) + P0 V0[:, L]; wait P1, m1 (``bar_p1``); O_L = O_L exp2(c (m0 - m1)) +
          P1 V1[:, L]; issue the QK of block 2i + 2 (left half, then - once P1 V1[:, L] is done - right half).
      C1: issue S1 = Q K1^T; wait P0, m0; O_R = O_R exp2(c (m - m0)) + P0 V0[:, R] (in flight during its
          softmax); m1 = max(m0, rowmax S1); P1 = bf16(exp2(c S1 - c m1)); publish P1, m1;
          O_R = O_R exp2(c (m0 - m1)) + P1 V1[:, R].

    Both consumers keep the fp32 probability sum of their own blocks, rescaled with their output half; at the
    end the two sums (under the same final max) and the sink exp2(sink log2e - c m) form the denominator, and
    LSE = log2(l) + c m as the other forwards. P0 / P1 are rewritten only after the other consumer's P V that
    reads them completed (``p_free``).

    ``ctas``: 0 = one CTA a query. Else a persistent grid of that many CTAs (the SM count), CTA c taking queries
    c, c + ctas, ...: the producer loads the next query's index row (double-buffered) as soon as it has issued the
    current query's gathers and its Q as soon as both consumers are past their last QK (``q_free``), and gathers
    its first pair as the stages free up, so a query's start overlaps the previous one's last pair; O then goes
    straight from the accumulators to global memory (q_s holds the next Q), except for a CTA's last query, whose O
    goes through q_s. Every per-pair barrier's phase runs on over the CTA's queries.

    ``diag`` (benchmark ablations only, wrong outputs): "compute" = the producer gathers the first pair only and then
    re-signals the stages (stale rows: the compute alone); "nosoftmax" = no row maxima or exponentials (P = S).
    Shared memory: Q + 2 * BI * D * 2 + 2 * 64 * BI * 2 + (1 or 2) * TP * 4 bytes.
    """
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if H != 64:
        raise ValueError("fwd_kernel_pp: H must be 64 (one warpgroup's WGMMA M)")
    if D % 128 or D > 512:
        raise ValueError("fwd_kernel_pp: D must be a multiple of 128, <= 512")
    if TP % (2 * BI) or BI % 16 or BI > 64:
        raise ValueError("fwd_kernel_pp: TP a multiple of 2*BI, BI a multiple of 16 up to 64")
    NB = 2 if ctas else 1               # index rows in shared memory
    if _pp_smem(H, D, TP, BI, NB) > 227 * 1024 - 2048:
        raise ValueError("fwd_kernel_pp: shared memory over 227 KB")
    check_nreg("fwd_kernel_pp", nreg)
    if diag not in ("", "compute", "nosoftmax"):
        raise ValueError(f"fwd_kernel_pp: diag {diag!r}")
    if ctas < 0:
        raise ValueError(f"fwd_kernel_pp: ctas must be 0 (a CTA a query) or the persistent grid size, got {ctas}")
    SM = diag != "nosoftmax"
    NI = TP // BI
    NP = NI // 2
    DH = D // 2
    c = float(scale) * LOG2E
    CPH = DH // 64                      # 16-byte chunks a producer thread copies per row half (8 threads a row)
    L, R = 0, 1

    @T.macro
    def epilogue(w, last, l, m, ls, acc_o, sum_s, q_s, Sink, O, Lse, bi, mi):
        """Consumer w, after both row sums are in sum_s and every WGMMA on q_s is done: l += the peer's sum + the
        sink exp2(sink log2e - c m); O[:, half w] = acc_o / l (through q_s on a CTA's ``last`` query, else straight
        from the accumulators: q_s holds the next query's Q); w == 0 stores LSE = log2(l) + c m."""
        for h in T.Parallel(H):
            l[h] = l[h] + sum_s[1 - w, h] + T.exp2(Sink[h] * LOG2E - m[h] * c)
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] /= l[h]
        if last:
            T.copy(acc_o, q_s[0, :, w * DH:(w + 1) * DH])
            T.copy(q_s[0, :, w * DH:(w + 1) * DH], O[bi, mi, :, w * DH:(w + 1) * DH])
        else:
            T.copy(acc_o, O[bi, mi, :, w * DH:(w + 1) * DH])
        if w == 0:
            for h in T.Parallel(H):
                ls[h] = T.log2(l[h]) + m[h] * c
            T.copy(ls, Lse[bi, mi, :])

    @T.macro
    def gather_half(tp, j, s, h, kv_s, idx_s, ib, src, KV, bi):
        """Block j's BI rows (index row ib), columns of half h, into stage s (thread tp of 128: 8 threads a row,
        16 rows a pass). The rows' indices are read first (TileLang fences shared reads after cp.async writes
        once, not per row)."""
        for r in T.unroll(BI // 16):
            src[r] = idx_s[ib, j * BI + r * 16 + tp // 8]
        for r in T.unroll(BI // 16):
            row = r * 16 + tp // 8
            for u in T.unroll(CPH):             # a hole (-1) fails the copy's bounds check: zero-filled, not read
                col = h * DH + u * 64 + (tp % 8) * 8
                T.ptx_cp_async(T.access_ptr(kv_s[s, row, col], "w", 8),
                               T.access_ptr(KV[bi, src[r], col], "r", 8), 8)

    @T.macro
    def seed(j, acc_s, idx_s, ib):
        """The QK accumulator's seed for block j: 0 at a slot, -inf at a hole."""
        for h, t in T.Parallel(H, BI):
            acc_s[h, t] = T.if_then_else(idx_s[ib, j * BI + t] >= 0, 0, -T.infinity(F32))

    @T.macro
    def qk_half(z, h, s, acc_s, q_s, kv_s):
        T.wgmma_gemm(q_s[z, :, h * DH:(h + 1) * DH], kv_s[z + s, :, h * DH:(h + 1) * DH], acc_s, transpose_B=True)

    @T.macro
    def pv(z, b, h, acc_o, p_s, kv_s):
        """acc_o += P_b V_b[:, half h] (P of block b of the pair, stage b)."""
        T.wgmma_gemm(p_s[z + b, :, :], kv_s[z + b, :, h * DH:(h + 1) * DH], acc_o)

    @T.macro
    def softmax1(acc_s, m0, m, a, ls, l):
        """Consumer 1's softmax of S1: m = m1 = max(m0, rowmax S1), a = exp2(c (m0 - m1)), S1 <- exp2(c S1 - c m1)
        (fp32), l = l a + rowsum (l was under m0)."""
        T.copy(m0, m)
        if SM:
            T.reduce_max(acc_s, m, dim=1, clear=False)
        for h in T.Parallel(H):
            a[h] = T.exp2((m0[h] - m[h]) * c)
        if SM:
            for h, t in T.Parallel(H, BI):
                acc_s[h, t] = T.exp2(acc_s[h, t] * c - m[h] * c)
            T.reduce_sum(acc_s, ls, dim=1)
        else:
            T.fill(ls, 1)
        for h in T.Parallel(H):
            l[h] = l[h] * a[h] + ls[h]

    @T.macro
    def rescale(acc_o, l, a, m_from, m_to):
        for h in T.Parallel(H):
            a[h] = T.exp2((m_from[h] - m_to[h]) * c)
        for h in T.Parallel(H):
            l[h] = l[h] * a[h]
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] *= a[h]

    @T.macro
    def consumer0(k, z, zs, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, bar_q, q_free, ready, free,
                  bar_p0, bar_p1, p_free0, p_free1):
        """Consumer 0's pairs of the CTA's k-th query (pair phases run on: gp = k NP + i)."""
        ib = k % NB
        T.barrier_wait(bar_q, k % 2)                    # Q and the index row
        z = zs[0]
        seed(0, acc_s, idx_s, ib)
        T.barrier_wait(ready[0 + L], (k * NP) % 2)
        qk_half(z, L, 0, acc_s, q_s, kv_s)
        T.barrier_wait(ready[0 + R], (k * NP) % 2)
        qk_half(z, R, 0, acc_s, q_s, kv_s)
        T.wait_wgmma(0)
        if NP == 1:
            T.barrier_arrive(q_free)                    # my last QK of this query is done
        for i in T.serial(NP):
            gp = k * NP + i
            z = zs[0]                                   # 0, unknown to ptxas: no WGMMA descriptor is hoisted
            T.copy(m, m0)                               # m0 = max(m, rowmax S0) ...
            if SM:
                T.reduce_max(acc_s, m0, dim=1, clear=False)
            rescale(acc_o, l, a, m, m0)                 # O_L, l under m0
            if SM:
                for h, t in T.Parallel(H, BI):
                    acc_s[h, t] = T.exp2(acc_s[h, t] * c - m0[h] * c)
                T.reduce_sum(acc_s, ls, dim=1)
            else:
                T.fill(ls, 1)
            for h in T.Parallel(H):
                l[h] = l[h] + ls[h]
            T.barrier_wait(p_free0, (gp % 2) ^ 1)      # consumer 1 is done with P0 of the pair before
            T.copy(acc_s, p_s[0, :, :])
            T.copy(m0, mx_s[0, :])
            T.fence_proxy_async()                       # P0: generic stores, read next by WGMMA (async proxy)
            T.barrier_arrive(bar_p0)
            pv(z, 0, L, acc_o, p_s, kv_s)
            T.barrier_wait(bar_p1, gp % 2)             # P1, m1 of this pair
            for h in T.Parallel(H):
                m[h] = mx_s[1, h]
            T.wait_wgmma(0)                             # P0 V0[:, L] done: stage 0's left half is free
            T.barrier_arrive(free[0 + L])
            rescale(acc_o, l, a, m0, m)                 # O_L, l under m1
            T.barrier_wait(ready[2 + L], gp % 2)
            pv(z, 1, L, acc_o, p_s, kv_s)
            if i < NP - 1:                              # S0 of the next pair (block 2i + 2, stage 0 refilled)
                seed(2 * i + 2, acc_s, idx_s, ib)
                T.barrier_wait(ready[0 + L], (gp + 1) % 2)
                qk_half(z, L, 0, acc_s, q_s, kv_s)
                T.wait_wgmma(1)                         # P1 V1[:, L] done
                T.barrier_arrive(free[2 + L])
                T.barrier_arrive(p_free1)
                T.barrier_wait(ready[0 + R], (gp + 1) % 2)
                qk_half(z, R, 0, acc_s, q_s, kv_s)
                T.wait_wgmma(0)
                if i == NP - 2:
                    T.barrier_arrive(q_free)            # my last QK of this query is done
            else:
                T.wait_wgmma(0)
                T.barrier_arrive(free[2 + L])
                T.barrier_arrive(p_free1)

    @T.macro
    def consumer1(k, z, zs, acc_s, acc_o, m, m0, a, ls, l, q_s, kv_s, idx_s, p_s, mx_s, bar_q, q_free, ready, free,
                  bar_p0, bar_p1, p_free0, p_free1):
        """Consumer 1's pairs of the CTA's k-th query."""
        ib = k % NB
        T.barrier_wait(bar_q, k % 2)
        for i in T.serial(NP):
            gp = k * NP + i
            z = zs[0]                                   # 0, unknown to ptxas: no WGMMA descriptor is hoisted
            seed(2 * i + 1, acc_s, idx_s, ib)
            T.barrier_wait(ready[2 + L], gp % 2)
            qk_half(z, L, 1, acc_s, q_s, kv_s)
            T.barrier_wait(ready[2 + R], gp % 2)
            qk_half(z, R, 1, acc_s, q_s, kv_s)
            T.barrier_wait(bar_p0, gp % 2)             # P0, m0 of this pair
            for h in T.Parallel(H):
                m0[h] = mx_s[0, h]
            T.wait_wgmma(0)                             # S1 done (O_R must not be touched while it runs)
            if i == NP - 1:
                T.barrier_arrive(q_free)                # my last QK of this query is done
            rescale(acc_o, l, a, m, m0)                 # O_R, l under m0
            T.barrier_wait(ready[0 + R], gp % 2)
            pv(z, 0, R, acc_o, p_s, kv_s)               # runs under the softmax
            softmax1(acc_s, m0, m, a, ls, l)            # m = m1, a = exp2(c (m0 - m1))
            T.barrier_wait(p_free1, (gp % 2) ^ 1)      # consumer 0 is done with P1 of the pair before
            T.copy(acc_s, p_s[1, :, :])
            T.copy(m, mx_s[1, :])
            T.fence_proxy_async()
            T.barrier_arrive(bar_p1)
            T.wait_wgmma(0)                             # P0 V0[:, R] done: stage 0's right half, P0 free
            T.barrier_arrive(free[0 + R])
            T.barrier_arrive(p_free0)
            for h, d in T.Parallel(H, DH):              # O_R under m1
                acc_o[h, d] *= a[h]
            pv(z, 1, R, acc_o, p_s, kv_s)
            T.wait_wgmma(0)
            T.barrier_arrive(free[2 + R])

    @T.macro
    def load_row(tp, n, ib, idx_s, Idx):
        """Query n's index row into idx_s[ib] (16 bytes a copy)."""
        for r in T.serial((TP // 4 + 127) // 128):
            if r * 128 + tp < TP // 4:
                T.ptx_cp_async(T.access_ptr(idx_s[ib, (r * 128 + tp) * 4], "w", 4),
                               T.access_ptr(Idx[n // M, n % M, (r * 128 + tp) * 4], "r", 4), 4)

    @T.macro
    def load_q(tp, n, q_s, Q):
        """Query n's Q [H, D] into q_s (8 threads a row, 16 rows a pass)."""
        for r in T.unroll(H // 16):
            for u in T.unroll(D // 64):
                T.ptx_cp_async(T.access_ptr(q_s[0, r * 16 + tp // 8, u * 64 + (tp % 8) * 8], "w", 8),
                               T.access_ptr(Q[n // M, n % M, r * 16 + tp // 8, u * 64 + (tp % 8) * 8], "r", 8), 8)

    @T.prim_func
    def sparse_attn_fwd_pp(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        Sink: T.Tensor([H], F32),
        Idx: T.Tensor([B, M, TP], I32),
        O: T.Tensor([B, M, H, D], BF16),
        Lse: T.Tensor([B, M, H], F32),
    ):
        with T.Kernel(ctas if ctas else B * M, threads=384) as cta:
            q_s = T.alloc_shared([1, H, D], BF16)      # [1, ...]: indexed by the runtime zero z (consumers)
            zs = T.alloc_shared([1], I32)
            kv_s = T.alloc_shared([2, BI, D], BF16)
            p_s = T.alloc_shared([2, H, BI], BF16)
            idx_s = T.alloc_shared([NB, TP], I32)
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

            bar_i = T.alloc_barrier(arrive_count=128)
            bar_q = T.alloc_barrier(arrive_count=128)
            q_free = T.alloc_barrier(arrive_count=256)
            ready = T.alloc_barrier(arrive_count=[128] * 4)
            free = T.alloc_barrier(arrive_count=[128] * 4)
            bar_p0 = T.alloc_barrier(arrive_count=128)
            bar_p1 = T.alloc_barrier(arrive_count=128)
            p_free0 = T.alloc_barrier(arrive_count=128)
            p_free1 = T.alloc_barrier(arrive_count=128)
            bar_end = T.alloc_barrier(arrive_count=256)

            G = ctas if ctas else B * M
            NQ = (B * M - cta + G - 1) // G             # this CTA's queries: cta, cta + G, ...
            z0 = T.alloc_var(I32)
            z1 = T.alloc_var(I32)
            tx = T.get_thread_binding()
            if tx == 0:
                zs[0] = 0
            T.sync_threads()
            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                for k in T.serial(NQ):
                    n = cta + k * G
                    T.fill(acc_o0, 0)
                    T.fill(l_0, 0)
                    T.fill(m_0, -1e30)
                    consumer0(k, z0, zs, acc_s0, acc_o0, m_0, m0_0, a_0, ls_0, l_0, q_s, kv_s, idx_s, p_s, mx_s, bar_q,
                              q_free, ready, free, bar_p0, bar_p1, p_free0, p_free1)
                    # both sums are under the final max (m1 of the last pair); the exchange also says both
                    # consumers are past their last WGMMA on q_s, which the last query's epilogue reuses for O
                    T.copy(l_0, sum_s[0, :])
                    T.barrier_arrive(bar_end)
                    T.barrier_wait(bar_end, k % 2)
                    epilogue(0, k == NQ - 1, l_0, m_0, ls_0, acc_o0, sum_s, q_s, Sink, O, Lse, n // M, n % M)
            elif tx < 256:
                T.set_max_nreg(nreg[0], 1)
                for k in T.serial(NQ):
                    n = cta + k * G
                    T.fill(acc_o1, 0)
                    T.fill(l_1, 0)
                    T.fill(m_1, -1e30)
                    consumer1(k, z1, zs, acc_s1, acc_o1, m_1, m0_1, a_1, ls_1, l_1, q_s, kv_s, idx_s, p_s, mx_s, bar_q,
                              q_free, ready, free, bar_p0, bar_p1, p_free0, p_free1)
                    T.copy(l_1, sum_s[1, :])
                    T.barrier_arrive(bar_end)
                    T.barrier_wait(bar_end, k % 2)
                    epilogue(1, k == NQ - 1, l_1, m_1, ls_1, acc_o1, sum_s, q_s, Sink, O, Lse, n // M, n % M)
            else:
                T.set_max_nreg(nreg[1], 0)
                tp = tx - 256
                src = T.alloc_local([BI // 16], I32)
                if NQ > 0:                                   # (a persistent grid may outnumber the queries)
                    load_row(tp, cta, 0, idx_s, Idx)
                    T.cp_async_barrier_noinc(bar_i)
                    load_q(tp, cta, q_s, Q)
                    T.cp_async_barrier_noinc(bar_q)
                for k in T.serial(NQ):
                    n = cta + k * G
                    T.barrier_wait(bar_i, k % 2)         # this query's whole index row is in idx_s[k % NB]
                    for i in T.serial(NP):
                        gp = k * NP + i
                        for s, h in ((0, L), (0, R), (1, L), (1, R)):
                            T.barrier_wait(free[2 * s + h], (gp % 2) ^ 1)
                            if diag == "compute":
                                if gp == 0:
                                    gather_half(tp, 2 * i + s, s, h, kv_s, idx_s, k % NB, src, KV, n // M)
                                    T.cp_async_barrier_noinc(ready[2 * s + h])
                                else:
                                    T.barrier_arrive(ready[2 * s + h])
                            else:
                                gather_half(tp, 2 * i + s, s, h, kv_s, idx_s, k % NB, src, KV, n // M)
                                T.cp_async_barrier_noinc(ready[2 * s + h])
                    if k < NQ - 1:                       # the next query: its index row now, its Q once q_s is free
                        load_row(tp, n + G, (k + 1) % NB, idx_s, Idx)
                        T.cp_async_barrier_noinc(bar_i)
                        T.barrier_wait(q_free, k % 2)
                        load_q(tp, n + G, q_s, Q)
                        T.cp_async_barrier_noinc(bar_q)

    return compile_kernel(sparse_attn_fwd_pp, out_idx=[4, 5])


def pp_fits(H: int, D: int, TP: int, BI: int = 64, persistent: bool = False) -> bool:
    """fwd_kernel_pp's shapes: 64 heads, D a multiple of 128 up to 512, TP a multiple of 2 * BI, and Q, two
    stages, P and the index row(s) within the shared memory."""
    return (H == 64 and D % 128 == 0 and D <= 512 and TP % (2 * BI) == 0
            and _pp_smem(H, D, TP, BI, 2 if persistent else 1) <= 227 * 1024 - 2048)
